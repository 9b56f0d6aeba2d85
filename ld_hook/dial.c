/*
 * Reaching the node scheduler's socket (see dial.h): a connected socket to a trusted peer, with
 * or without waiting for room in its backlog; and nvs_dial_ask, one question on a socket of its
 * own, for a process that has no connection yet (the GPU's view before REGISTER).
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "dial.h"
#include "frames.h"
#include "thread.h"

#define ASK_MAX_WAIT_MS 2000u

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

/* A connected socket; NVS_DIAL_NO_SOCKET when nobody answers, NVS_DIAL_IMPOSTOR when a stranger does, NVS_DIAL_BUSY when
 * a listener is there but took no connection: its backlog stayed full (EAGAIN) or it is between
 * listen() calls (ECONNREFUSED on an existing socket file). With `patience_ns` 0 the connect
 * does not block; otherwise it waits in the kernel for room in the backlog (woken by the
 * daemon's next accept, not by polling) for up to that long. */
int nvs_dial(uint64_t patience_ns)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (patience_ns ? 0 : SOCK_NONBLOCK), 0);
    if (fd < 0) return NVS_DIAL_NO_SOCKET;
    struct timeval tv = {.tv_sec = (time_t)(patience_ns / 1000000000ull),
                         .tv_usec = (suseconds_t)(patience_ns % 1000000000ull / 1000)};
    if (patience_ns) setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, nvs_cfg.socket_path, strlen(nvs_cfg.socket_path) + 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int busy = errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED ||
                   errno == EINTR;
        close(fd);
        return busy ? NVS_DIAL_BUSY : NVS_DIAL_NO_SOCKET;
    }
    if (!trusted_peer(fd)) {
        close(fd);
        return NVS_DIAL_IMPOSTOR;
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
int nvs_dial_patiently(uint64_t timeout_ns)
{
    uint64_t deadline = nvs_now_ns() + timeout_ns;
    uint32_t wait_ms = REFUSED_FIRST_WAIT_MS;
    for (;;) {
        uint64_t now = nvs_now_ns();
        if (now >= deadline) return NVS_DIAL_BUSY;
        int fd = nvs_dial(deadline - now);
        if (fd != NVS_DIAL_BUSY) return fd;
        now = nvs_now_ns();
        if (now >= deadline) return NVS_DIAL_BUSY;
        uint64_t left_ms = (deadline - now) / 1000000ull;
        uint32_t nap_ms = wait_ms < left_ms ? wait_ms : (uint32_t)left_ms;
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)nap_ms * 1000000L};
        nanosleep(&ts, NULL);
        wait_ms = wait_ms * 2 > REFUSED_MAX_WAIT_MS ? REFUSED_MAX_WAIT_MS : wait_ms * 2;
    }
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

int nvs_dial_ask(uint16_t type, const void *body, uint32_t len, uint16_t reply_type, void *reply,
                 uint32_t reply_len)
{
    if (!nvs_cfg.socket_usable || len > NVS_FRAME_BODY_CAP) return -1;
    uint32_t wait_ms = nvs_cfg.daemon_timeout_ms < ASK_MAX_WAIT_MS ? nvs_cfg.daemon_timeout_ms
                                                                    : ASK_MAX_WAIT_MS;
    uint64_t deadline = nvs_now_ns() + (uint64_t)wait_ms * 1000000ull;
    int fd = nvs_dial(0); /* a full backlog fails at once */
    if (fd < 0) return -1;
    char out[sizeof(struct nvs_header) + NVS_FRAME_BODY_CAP];
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
