/*
 * The connection to the node scheduler (see conn.h). Per GPU: a state, a socket owned by its
 * reader thread (only the reader closes it; others shut it down), and an outbox sent with
 * MSG_DONTWAIT. The reader is the only place where a connection goes down, so the handler hears
 * NVS_EV_DOWN exactly once per connection.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "conn.h"
#include "dial.h"
#include "frames.h"
#include "log.h"
#include "thread.h"

#define OUTBOX_BYTES 16384
#define FIRST_BACKOFF_MS 100
#define MAX_BACKOFF_MS 5000

/* A socket file's identity; ino 0: none. The change time too, since a file system may give a
 * new file the number of one just removed. */
struct socket_file {
    dev_t dev;
    ino_t ino;
    struct timespec ctime;
};

enum conn_state { CONN_UNUSED = 0, CONN_CONNECTING, CONN_UP, CONN_DOWN };

struct conn {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    enum conn_state state;
    int fd;                /* the live socket, -1 when none; closed only by its reader */
    unsigned generation;   /* bumped per connection: a stale reader leaves quietly */
    int first_use;         /* the registration of the first use is in flight */
    uint64_t seq, register_seq;
    uint64_t connect_ns;   /* when the current attempt began */
    uint64_t awaiting_ns;  /* first request sent since the last frame arrived, 0 = none */
    uint64_t last_tx_ns;
    uint64_t backoff_ms, retry_ns;
    struct socket_file sock; /* as it was when the connection went down: a new one is a
                              * restarted scheduler */
    const char *why;       /* why nvs_conn_fail gave up on this connection */
    size_t out_len;
    char out[OUTBOX_BYTES];
};

static struct conn conns[NVS_MAX_GPUS];
static nvs_event_handler handler;

static const char WHY_UNREACHABLE[] = "cannot reach the nvshare scheduler";
static const char WHY_BUSY[] =
    "the nvshare scheduler's socket accepted no connection within NVSHARE_DAEMON_TIMEOUT_MS "
    "(its backlog stayed full, or nobody listened on it)";
static const char WHY_LOST[] = "lost the connection to the nvshare scheduler";
static const char WHY_SILENT[] = "the nvshare scheduler stopped answering";
static const char WHY_NO_REGISTRATION[] = "the nvshare scheduler did not answer the registration";
static const char WHY_NOT_READING[] = "the nvshare scheduler stopped reading its socket";
static const char WHY_NO_PATH[] = "the scheduler socket path does not fit in a Unix socket address";
static const char WHY_IMPOSTOR[] =
    "the socket is served by a process of another user (neither root nor this process's), "
    "which is not trusted as the nvshare scheduler";

static struct conn *conn_of(const struct nvs_gpu *g) { return &conns[g->index]; }

static uint64_t timeout_ns(void) { return (uint64_t)nvs_cfg.daemon_timeout_ms * 1000000ull; }

static uint64_t heartbeat_ns(void)
{
    uint64_t t = timeout_ns() / 4;
    return t > 1000000000ull ? 1000000000ull : t;
}

static void init_one(struct conn *c)
{
    pthread_mutex_init(&c->mu, NULL);
    nvs_cond_init(&c->cv);
    c->state = CONN_UNUSED;
    c->fd = -1;
    c->first_use = 0;
    c->out_len = 0;
    c->awaiting_ns = 0;
    c->why = NULL;
    c->backoff_ms = FIRST_BACKOFF_MS;
}

void nvs_conn_init(nvs_event_handler h)
{
    handler = h;
    for (int i = 0; i < NVS_MAX_GPUS; i++) init_one(&conns[i]);
}

/* ------------------------------------------------------------------ sending */

static int expects_reply(uint16_t type)
{
    return type == NVS_MSG_REGISTER || type == NVS_MSG_MEM_RESERVE || type == NVS_MSG_HEARTBEAT;
}

/* With c->mu held: shut the socket down; its reader sees EOF and takes the connection down. */
static void fail_locked(struct conn *c, const char *why)
{
    if ((c->state != CONN_UP && c->state != CONN_CONNECTING) || c->fd < 0) return;
    if (c->why == NULL) c->why = why;
    shutdown(c->fd, SHUT_RDWR);
}

static int queue_locked(struct conn *c, uint16_t type, const void *body, uint32_t len,
                        uint64_t *seq)
{
    if (c->fd < 0 || c->why != NULL || (c->state != CONN_UP && c->state != CONN_CONNECTING))
        return -1;
    struct nvs_header h = {.magic = NVS_MAGIC, .version = NVS_PROTO_VERSION, .type = type,
                           .flags = 0, .body_len = len, .seq = ++c->seq};
    if (c->out_len + sizeof h + len > sizeof c->out) {
        fail_locked(c, WHY_NOT_READING);
        return -1;
    }
    memcpy(c->out + c->out_len, &h, sizeof h);
    if (len > 0) memcpy(c->out + c->out_len + sizeof h, body, len);
    c->out_len += sizeof h + len;
    uint64_t now = nvs_now_ns();
    if (expects_reply(type) && c->awaiting_ns == 0) c->awaiting_ns = now;
    c->last_tx_ns = now;
    if (seq != NULL) *seq = h.seq;
    return 0;
}

/* With c->mu held: send what the socket takes now; the rest waits for the next flush or tick. */
static void flush_locked(struct conn *c)
{
    while (c->out_len > 0 && c->fd >= 0 && c->why == NULL) {
        ssize_t n = send(c->fd, c->out, c->out_len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            memmove(c->out, c->out + n, c->out_len - (size_t)n);
            c->out_len -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else {
            fail_locked(c, WHY_LOST);
            return;
        }
    }
}

int nvs_conn_queue(struct nvs_gpu *g, uint16_t type, const void *body, uint32_t len, uint64_t *seq)
{
    struct conn *c = conn_of(g);
    nvs_mutex_lock(&c->mu);
    int rc = queue_locked(c, type, body, len, seq);
    nvs_mutex_unlock(&c->mu);
    return rc;
}

void nvs_conn_flush(struct nvs_gpu *g)
{
    struct conn *c = conn_of(g);
    nvs_mutex_lock(&c->mu);
    flush_locked(c);
    nvs_mutex_unlock(&c->mu);
}

void nvs_conn_fail(struct nvs_gpu *g, const char *why)
{
    struct conn *c = conn_of(g);
    nvs_mutex_lock(&c->mu);
    fail_locked(c, why);
    nvs_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------ going down */

static void announce_down(struct nvs_gpu *g, const char *why)
{
    nvs_notice_once("%s (%s); GPU %d runs without sharing, keeping its last known limits, and "
                    "reconnects in the background",
                    why, nvs_cfg.socket_path, g->index);
    NVS_DEBUG("GPU %d: %s; ungated until the scheduler is back", g->index, why);
    struct nvs_event ev = {.kind = NVS_EV_DOWN, .u.why = why};
    handler(g, &ev);
}

static struct socket_file socket_file_now(void)
{
    struct stat st;
    struct socket_file f = {0};
    if (nvs_cfg.socket_usable && stat(nvs_cfg.socket_path, &st) == 0 && S_ISSOCK(st.st_mode)) {
        f.dev = st.st_dev;
        f.ino = st.st_ino;
        f.ctime = st.st_ctim;
    }
    return f;
}

/* With c->mu held, while down: whether a socket file other than the one that went down is
 * there now. A restarted scheduler binds a new one; waiting out the backoff instead (up to
 * 5 s, doubling from 100 ms) kept 100 programs from their scheduler 1-3 s after it listened. */
static int socket_replaced_locked(struct conn *c)
{
    struct socket_file f = socket_file_now();
    if (f.ino == 0 || (f.dev == c->sock.dev && f.ino == c->sock.ino &&
                       f.ctime.tv_sec == c->sock.ctime.tv_sec &&
                       f.ctime.tv_nsec == c->sock.ctime.tv_nsec))
        return 0;
    c->sock = f;
    return 1;
}

/* With c->mu held: the attempt or connection is over. */
static void down_locked(struct conn *c)
{
    c->state = CONN_DOWN;
    c->generation++;
    c->fd = -1;
    c->out_len = 0;
    c->awaiting_ns = 0;
    c->why = NULL;
    c->first_use = 0;
    c->sock = socket_file_now();
    c->retry_ns = nvs_now_ns() + c->backoff_ms * 1000000ull;
    c->backoff_ms = c->backoff_ms * 2 > MAX_BACKOFF_MS ? MAX_BACKOFF_MS : c->backoff_ms * 2;
    pthread_cond_broadcast(&c->cv);
}

struct reader_arg {
    struct nvs_gpu *g;
    int fd;
    unsigned generation;
};

/* Delivers one event unless the connection it came on was replaced meanwhile. */
static int current(struct conn *c, unsigned generation, int frame_arrived)
{
    nvs_mutex_lock(&c->mu);
    int same = c->generation == generation;
    if (same && frame_arrived) c->awaiting_ns = 0;
    nvs_mutex_unlock(&c->mu);
    return same;
}

static void registered(struct nvs_gpu *g, struct conn *c, unsigned generation,
                       const struct nvs_event *ev)
{
    handler(g, ev);
    nvs_mutex_lock(&c->mu);
    if (c->generation == generation) {
        c->state = CONN_UP;
        c->first_use = 0;
        c->backoff_ms = FIRST_BACKOFF_MS;
        pthread_cond_broadcast(&c->cv);
    }
    flush_locked(c);
    nvs_mutex_unlock(&c->mu);
    NVS_DEBUG("GPU %d (%s): registered as client %llu", g->index, g->uuid,
              (unsigned long long)ev->u.registered.client_id);
}

static void *reader_main(void *p)
{
    struct reader_arg a = *(struct reader_arg *)p;
    free(p);
    struct nvs_gpu *g = a.g;
    struct conn *c = conn_of(g);
    const char *why = NULL;
    int is_registered = 0;
    for (;;) {
        struct nvs_header h;
        _Alignas(8) char body[NVS_FRAME_BODY_CAP];
        uint32_t len = 0;
        int rc = nvs_frame_read(g, a.fd, &h, body, &len, &why);
        if (rc < 0 || !current(c, a.generation, 1)) break;
        struct nvs_event ev;
        if (rc != 0 || !nvs_frame_decode(g, &h, body, len, &ev)) continue;
        if (!is_registered) {
            if (ev.kind != NVS_EV_REGISTERED) {
                why = WHY_NO_REGISTRATION;
                break;
            }
            registered(g, c, a.generation, &ev);
            is_registered = 1;
        } else if (ev.kind != NVS_EV_REGISTERED) {
            handler(g, &ev);
        }
    }
    nvs_mutex_lock(&c->mu);
    int mine = c->generation == a.generation;
    if (mine) {
        if (c->why != NULL) why = c->why;
        if (why == NULL) why = is_registered ? WHY_LOST : WHY_UNREACHABLE;
        down_locked(c);
    }
    nvs_mutex_unlock(&c->mu);
    close(a.fd);
    if (mine) announce_down(g, why);
    return NULL;
}

/* ------------------------------------------------------------------ connecting */

/* With c->mu held: begin an attempt on `fd`, what nvs_dial gave. NULL, or why it failed at
 * once (caller announces it). */
static const char *start_locked(struct nvs_gpu *g, struct conn *c, int fd)
{
    if (!nvs_cfg.socket_usable) {
        if (fd >= 0) close(fd);
        down_locked(c);
        return WHY_NO_PATH;
    }
    struct reader_arg *a = fd >= 0 ? malloc(sizeof *a) : NULL;
    if (a == NULL) {
        if (fd >= 0) close(fd);
        down_locked(c);
        return fd == NVS_DIAL_IMPOSTOR ? WHY_IMPOSTOR : fd == NVS_DIAL_BUSY ? WHY_BUSY : WHY_UNREACHABLE;
    }
    c->state = CONN_CONNECTING;
    c->generation++;
    c->fd = fd;
    c->why = NULL;
    c->out_len = 0;
    c->awaiting_ns = 0;
    c->connect_ns = nvs_now_ns();
    struct nvs_register reg;
    memset(&reg, 0, sizeof reg);
    reg.pid = (uint32_t)getpid();
    reg.env_core_limit = nvs_cfg.env_core_limit;
    reg.gpu_total_mem = g->total_mem;
    reg.env_mem_limit = nvs_cfg.env_mem_limit;
    memcpy(reg.gpu_uuid, g->uuid, sizeof reg.gpu_uuid);
    memcpy(reg.pod_namespace, nvs_cfg.pod_namespace, sizeof reg.pod_namespace);
    memcpy(reg.pod_name, nvs_cfg.pod_name, sizeof reg.pod_name);
    queue_locked(c, NVS_MSG_REGISTER, &reg, sizeof reg, &c->register_seq);
    if (nvs_cfg.gang[0] != '\0') {
        struct nvs_gang_hint hint;
        memcpy(hint.name, nvs_cfg.gang, sizeof hint.name);
        queue_locked(c, NVS_MSG_GANG_HINT, &hint, sizeof hint, NULL);
    }
    if (nvs_cfg.has_priority) {
        struct nvs_priority_hint hint = {.priority = nvs_cfg.priority};
        queue_locked(c, NVS_MSG_PRIORITY_HINT, &hint, sizeof hint, NULL);
    }
    flush_locked(c);
    *a = (struct reader_arg){.g = g, .fd = fd, .generation = c->generation};
    if (nvs_thread_start("nvshare-reader", reader_main, a) != 0) {
        free(a);
        close(fd);
        down_locked(c);
        return "cannot start the connection's reader thread";
    }
    return NULL;
}

void nvs_conn_use(struct nvs_gpu *g)
{
    struct conn *c = conn_of(g);
    nvs_mutex_lock(&c->mu);
    int unused = c->state == CONN_UNUSED;
    nvs_mutex_unlock(&c->mu);
    int fd = NVS_DIAL_NO_SOCKET;
    if (unused) {
        nvs_gpu_identify(g);
        if (nvs_cfg.socket_usable) fd = nvs_dial_patiently(timeout_ns());
    }
    nvs_mutex_lock(&c->mu);
    const char *failed = NULL;
    if (c->state == CONN_UNUSED) {
        c->first_use = 1;
        failed = start_locked(g, c, fd);
    } else if (fd >= 0) {
        close(fd); /* another thread of this process began first */
    }
    uint64_t deadline = c->connect_ns + timeout_ns();
    while (failed == NULL && c->first_use && c->state == CONN_CONNECTING) {
        uint64_t now = nvs_now_ns();
        if (now >= deadline) fail_locked(c, WHY_NO_REGISTRATION);
        struct timespec ts = nvs_deadline_ms(now >= deadline ? 100 : (deadline - now) / 1000000 + 1);
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    nvs_mutex_unlock(&c->mu);
    if (failed != NULL) announce_down(g, failed);
}

void nvs_conn_tick(struct nvs_gpu *g, uint64_t now)
{
    struct conn *c = conn_of(g);
    nvs_mutex_lock(&c->mu);
    switch (c->state) {
    case CONN_UP:
        if (nvs_elapsed(now, c->last_tx_ns) >= heartbeat_ns()) queue_locked(c, NVS_MSG_HEARTBEAT, NULL, 0, NULL);
        flush_locked(c);
        if (c->awaiting_ns != 0 && nvs_elapsed(now, c->awaiting_ns) > timeout_ns()) fail_locked(c, WHY_SILENT);
        break;
    case CONN_CONNECTING:
        flush_locked(c);
        if (nvs_elapsed(now, c->connect_ns) > timeout_ns()) fail_locked(c, WHY_NO_REGISTRATION);
        break;
    case CONN_DOWN:
        /* a failed retry is no news: the handler already heard that this GPU is down */
        if (socket_replaced_locked(c)) {
            c->backoff_ms = FIRST_BACKOFF_MS; /* bound, perhaps not listening yet: soon again */
            c->retry_ns = now;
        }
        if (now >= c->retry_ns)
            (void)start_locked(g, c, nvs_cfg.socket_usable ? nvs_dial(0) : NVS_DIAL_NO_SOCKET);
        break;
    case CONN_UNUSED:
        break;
    }
    nvs_mutex_unlock(&c->mu);
}

void nvs_conn_after_fork(void)
{
    for (int i = 0; i < NVS_MAX_GPUS; i++) {
        if (conns[i].fd >= 0) close(conns[i].fd);
        init_one(&conns[i]);
        conns[i].generation++;
    }
    nvs_frames_after_fork();
}
