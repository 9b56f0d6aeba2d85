/*
 * The connection to the node scheduler (see conn.h). Per GPU: a state, a socket owned by its
 * reader thread (only the reader closes it; others shut it down), and an outbox sent with
 * MSG_DONTWAIT. The reader is the only place where a connection goes down, so the handler hears
 * NVS_EV_DOWN exactly once per connection.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "conn.h"
#include "log.h"
#include "thread.h"

#define OUTBOX_BYTES 16384
#define BODY_CAP 512 /* larger than any frame the hook accepts */
#define FIRST_BACKOFF_MS 100
#define MAX_BACKOFF_MS 5000
#define MAX_REPORTED_MALFORMED 5
#define ASK_MAX_WAIT_MS 2000u

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
    const char *why;       /* why nvs_conn_fail gave up on this connection */
    size_t out_len;
    char out[OUTBOX_BYTES];
};

static struct conn conns[NVS_MAX_GPUS];
static nvs_event_handler handler;
static atomic_int malformed_reported;

static const char WHY_UNREACHABLE[] = "cannot reach the nvshare scheduler";
static const char WHY_BUSY[] =
    "the nvshare scheduler's socket accepted no connection within NVSHARE_DAEMON_TIMEOUT_MS "
    "(its backlog stayed full, or nobody listened on it)";
static const char WHY_LOST[] = "lost the connection to the nvshare scheduler";
static const char WHY_SILENT[] = "the nvshare scheduler stopped answering";
static const char WHY_NO_REGISTRATION[] = "the nvshare scheduler did not answer the registration";
static const char WHY_NOT_READING[] = "the nvshare scheduler stopped reading its socket";
static const char WHY_GARBAGE[] = "the nvshare scheduler sent something that is not an nvshare frame";
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

/* ------------------------------------------------------------------ receiving */

static int read_all(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void report_malformed(const struct nvs_gpu *g, unsigned type, const char *what)
{
    int n = atomic_fetch_add(&malformed_reported, 1);
    if (n < MAX_REPORTED_MALFORMED)
        nvs_log("GPU %d: ignored a frame of type %u from the scheduler: %s%s", g->index, type, what,
                n == MAX_REPORTED_MALFORMED - 1 ? " (further ones are not reported)" : "");
}

/* One frame: 0 = in *h / body, 1 = skipped (already reported), -1 = the stream is unusable. */
static int read_frame(const struct nvs_gpu *g, int fd, struct nvs_header *h, char *body,
                      uint32_t *kept, const char **why)
{
    if (read_all(fd, h, sizeof *h) != 0) return -1;
    if (h->magic != NVS_MAGIC || h->body_len > NVS_MAX_BODY) {
        *why = WHY_GARBAGE;
        return -1;
    }
    *kept = h->body_len < BODY_CAP ? h->body_len : BODY_CAP;
    if (*kept > 0 && read_all(fd, body, *kept) != 0) return -1;
    char sink[256];
    for (uint32_t left = h->body_len - *kept; left > 0;) {
        uint32_t n = left < sizeof sink ? left : (uint32_t)sizeof sink;
        if (read_all(fd, sink, n) != 0) return -1;
        left -= n;
    }
    if (h->version != NVS_PROTO_VERSION) {
        report_malformed(g, h->type, "protocol version not spoken here");
        return 1;
    }
    if (h->body_len > BODY_CAP) {
        report_malformed(g, h->type, "body too long");
        return 1;
    }
    return 0;
}

static const char *check_limits(const struct nvs_limits *l)
{
    if (l->core_limit < 1 || l->core_limit > 100) return "core limit outside 1-100";
    if (l->mode > NVS_MODE_AUTO) return "unknown mode";
    if (l->backing > NVS_BACKING_MANAGED) return "unknown memory backing";
    if (l->flags & ~NVS_LIMIT_KNOWN_FLAGS) return "unknown limit flags";
    return NULL;
}

/* A frame's body as a typed event; 0 when there is nothing to deliver (reported if malformed). */
static int decode(const struct nvs_gpu *g, const struct nvs_header *h, const char *body,
                  uint32_t len, struct nvs_event *ev)
{
    static const struct {
        uint16_t type;
        uint32_t len;
        enum nvs_event_kind kind;
    } shapes[] = {
        {NVS_MSG_REGISTERED, sizeof(struct nvs_registered), NVS_EV_REGISTERED},
        {NVS_MSG_LIMIT_UPDATE, sizeof(struct nvs_limits), NVS_EV_LIMITS},
        {NVS_MSG_LOCK_GRANT, sizeof(struct nvs_lock_grant), NVS_EV_LOCK_GRANT},
        {NVS_MSG_LOCK_TERMS, sizeof(struct nvs_lock_grant), NVS_EV_LOCK_TERMS},
        {NVS_MSG_LOCK_DROP, 0, NVS_EV_LOCK_DROP},
        {NVS_MSG_LOCK_LENT, 0, NVS_EV_LOCK_LENT},
        {NVS_MSG_LOCK_UNLENT, 0, NVS_EV_LOCK_UNLENT},
        {NVS_MSG_MEM_GRANT, sizeof(struct nvs_mem_grant), NVS_EV_MEM_GRANT},
        {NVS_MSG_MEM_OBSERVED, sizeof(struct nvs_mem_observed), NVS_EV_MEM_OBSERVED},
        {NVS_MSG_LEDGER_PEERS, sizeof(struct nvs_ledger_peers), NVS_EV_LEDGER_PEERS},
        {NVS_MSG_ERROR, sizeof(struct nvs_result), NVS_EV_ERROR},
        {NVS_MSG_GANG_DROP, sizeof(struct nvs_gang_cut), NVS_EV_GANG_DROP},
        {NVS_MSG_GANG_CUT, sizeof(struct nvs_gang_cut), NVS_EV_GANG_CUT},
        {NVS_MSG_GANG_CUT_OVER, sizeof(struct nvs_gang_cut), NVS_EV_GANG_CUT_OVER},
        {NVS_MSG_HEARTBEAT_ACK, 0, NVS_EV_ERROR /* not delivered */},
    };
    size_t i = 0;
    while (i < sizeof shapes / sizeof shapes[0] && shapes[i].type != h->type) i++;
    if (i == sizeof shapes / sizeof shapes[0]) {
        NVS_DEBUG("GPU %d: ignoring frame type %u", g->index, h->type);
        return 0;
    }
    if (len != shapes[i].len) {
        report_malformed(g, h->type, "wrong body length");
        return 0;
    }
    if (h->type == NVS_MSG_HEARTBEAT_ACK) return 0;
    memset(ev, 0, sizeof *ev);
    ev->kind = shapes[i].kind;
    ev->seq = h->seq;
    memcpy(&ev->u, body, len);
    const char *bad = NULL;
    if (ev->kind == NVS_EV_REGISTERED) bad = check_limits(&ev->u.registered.limits);
    if (ev->kind == NVS_EV_LIMITS) bad = check_limits(&ev->u.limits);
    if (ev->kind == NVS_EV_MEM_GRANT && ev->u.mem.granted > ev->u.mem.reserved)
        bad = "grant larger than the reservation it reports";
    if (ev->kind == NVS_EV_LEDGER_PEERS && (ev->u.peers.clients < 1 || ev->u.peers.clients > 65536))
        bad = "process count outside 1-65536";
    if (ev->kind == NVS_EV_ERROR && ev->u.error.status == NVS_OK) bad = "an error with status 0";
    if (bad != NULL) {
        report_malformed(g, h->type, bad);
        return 0;
    }
    if (ev->kind == NVS_EV_ERROR) ev->u.error.message[NVS_MESSAGE_LEN - 1] = '\0';
    return 1;
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
        _Alignas(8) char body[BODY_CAP];
        uint32_t len = 0;
        int rc = read_frame(g, a.fd, &h, body, &len, &why);
        if (rc < 0 || !current(c, a.generation, 1)) break;
        struct nvs_event ev;
        if (rc != 0 || !decode(g, &h, body, len, &ev)) continue;
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

/* The daemon may set this process's limits and hold its GPU: only root or our own user may be
 * it. Someone else's socket where ours should be (a shared directory created first by another
 * user) is an impostor: no limits, no lock from it. */
static int trusted_peer(int fd)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
    return cred.uid == 0 || cred.uid == geteuid();
}

#define REFUSED_FIRST_WAIT_MS 2
#define REFUSED_MAX_WAIT_MS 100
#define NO_SOCKET (-1)
#define IMPOSTOR (-2)
#define BUSY (-3)

/* A connected socket; NO_SOCKET when nobody answers, IMPOSTOR when a stranger does, BUSY when
 * a listener is there but took no connection: its backlog stayed full (EAGAIN) or it is between
 * listen() calls (ECONNREFUSED on an existing socket file). With `patience_ns` 0 the connect
 * does not block; otherwise it waits in the kernel for room in the backlog (woken by the
 * daemon's next accept, not by polling) for up to that long. */
static int open_socket(uint64_t patience_ns)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (patience_ns ? 0 : SOCK_NONBLOCK), 0);
    if (fd < 0) return NO_SOCKET;
    struct timeval tv = {.tv_sec = (time_t)(patience_ns / 1000000000ull),
                         .tv_usec = (suseconds_t)(patience_ns % 1000000000ull / 1000)};
    if (patience_ns) setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, nvs_cfg.socket_path, strlen(nvs_cfg.socket_path) + 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int busy = errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED ||
                   errno == EINTR;
        close(fd);
        return busy ? BUSY : NO_SOCKET;
    }
    if (!trusted_peer(fd)) {
        close(fd);
        return IMPOSTOR;
    }
    if (patience_ns) {
        struct timeval none = {0};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
    } else {
        int flags = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK); /* the reader blocks; sends use MSG_DONTWAIT */
    }
    return fd;
}

/* A full backlog is not "no scheduler": one process connecting and closing in a loop fills it,
 * and every program starting meanwhile would run unshared. So a busy socket is waited for, up to
 * NVSHARE_DAEMON_TIMEOUT_MS in all (a refused one retried with backoff); a missing one (no
 * daemon) fails at once. Called without any connection mutex held: the background ticks of the
 * other GPUs go on meanwhile. */
static int open_socket_patiently(void)
{
    uint64_t deadline = nvs_now_ns() + timeout_ns();
    uint32_t wait_ms = REFUSED_FIRST_WAIT_MS;
    for (;;) {
        uint64_t now = nvs_now_ns();
        if (now >= deadline) return BUSY;
        int fd = open_socket(deadline - now);
        if (fd != BUSY) return fd;
        now = nvs_now_ns();
        if (now >= deadline) return BUSY;
        uint64_t left_ms = (deadline - now) / 1000000ull;
        uint32_t nap_ms = wait_ms < left_ms ? wait_ms : (uint32_t)left_ms;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)nap_ms * 1000000L};
        nanosleep(&ts, NULL);
        wait_ms = wait_ms * 2 > REFUSED_MAX_WAIT_MS ? REFUSED_MAX_WAIT_MS : wait_ms * 2;
    }
}

/* With c->mu held: begin an attempt on `fd`, what open_socket gave. NULL, or why it failed at
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
        return fd == IMPOSTOR ? WHY_IMPOSTOR : fd == BUSY ? WHY_BUSY : WHY_UNREACHABLE;
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
    int fd = NO_SOCKET;
    if (unused) {
        nvs_gpu_identify(g);
        if (nvs_cfg.socket_usable) fd = open_socket_patiently();
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
        if (now >= c->retry_ns)
            (void)start_locked(g, c, nvs_cfg.socket_usable ? open_socket(0) : NO_SOCKET);
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
    atomic_store(&malformed_reported, 0);
}

/* ------------------------------------------------------------------ one question */

/* With a deadline: all of buf from fd, waiting in poll() only. */
static int read_by(int fd, void *buf, size_t len, uint64_t deadline_ns)
{
    char *p = buf;
    while (len > 0) {
        uint64_t now = nvs_now_ns();
        if (now >= deadline_ns) return -1;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int ready = poll(&pfd, 1, (int)((deadline_ns - now) / 1000000 + 1));
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) return -1;
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int nvs_conn_ask(uint16_t type, const void *body, uint32_t len, uint16_t reply_type, void *reply,
                 uint32_t reply_len)
{
    if (!nvs_cfg.socket_usable || len > BODY_CAP) return -1;
    uint32_t wait_ms = nvs_cfg.daemon_timeout_ms < ASK_MAX_WAIT_MS ? nvs_cfg.daemon_timeout_ms
                                                                    : ASK_MAX_WAIT_MS;
    uint64_t deadline = nvs_now_ns() + (uint64_t)wait_ms * 1000000ull;
    int fd = open_socket(0); /* a full backlog fails at once */
    if (fd < 0) return -1;
    char out[sizeof(struct nvs_header) + BODY_CAP];
    struct nvs_header h = {.magic = NVS_MAGIC, .version = NVS_PROTO_VERSION, .type = type,
                           .body_len = len, .seq = 1};
    memcpy(out, &h, sizeof h);
    memcpy(out + sizeof h, body, len);
    /* one small frame fits the socket's buffer: the send never waits */
    int ok = send(fd, out, sizeof h + len, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)(sizeof h + len) &&
             read_by(fd, &h, sizeof h, deadline) == 0 && h.magic == NVS_MAGIC &&
             h.version == NVS_PROTO_VERSION && h.seq == 1 && h.type == reply_type &&
             h.body_len == reply_len && read_by(fd, reply, reply_len, deadline) == 0;
    close(fd);
    return ok ? 0 : -1;
}
