/* A packet-level delay line: every Ethernet frame that arrives on interface A leaves on
 * interface B a fixed delay later, and the same from B to A. It works below TCP, so the TCP
 * endpoints on either side see the delay as path latency: their windows, slow start and ACK
 * clocking all run against the round trip.
 *
 *   delay_line IF_A IF_B DELAY_US STATS_FILE [QUEUE_BYTES]
 *
 * One AF_PACKET socket per interface (ETH_P_ALL, our own sends ignored) with PACKET_VNET_HDR:
 * a frame is read with the virtio header that describes its GSO segmentation and checksum
 * state, and written back with it, so a sender's 64 KiB TSO frame crosses as one frame (the
 * kernel segments it where it must) and a partial checksum stays partial. That keeps the
 * frames per second, and so this program's CPU, far below one MTU at a time (a bulk flow here
 * crossed in frames of 62 KB on average), and the cluster's token buckets see the same frames
 * as without the line.
 *
 * Each direction is a FIFO in one byte ring (QUEUE_BYTES each, default 64 MiB: more than the
 * bandwidth-delay product of 1 Gbit/s x 200 ms, 25 MB). An entry is its due time, its length
 * and the frame. A frame that finds its ring (or its socket) full is dropped and counted,
 * never blocked on.
 *
 * Each frame is due DELAY_US after the kernel received it (SO_TIMESTAMPNS), so the program need
 * not wake the moment a frame arrives: with frames queued it sleeps until the earliest is due
 * (and at most IDLE_NS, so that a socket never holds more than that much traffic), reads what
 * arrived (recvmmsg), and sends every head due (sendmmsg, in order). A constant delay keeps
 * the FIFO in due order, so a frame read late is never due before those queued. A wake-up
 * sends what falls due within the next QUANTUM (DELAY_US / 16, at most 200 us) too: a frame
 * leaves up to half a quantum early or late, the delay is right on average, and the timed
 * wake-ups stay below 1 / QUANTUM a second whatever the frame rate. With nothing queued it
 * sleeps until a frame arrives.
 *
 * Counters live in STATS_FILE, a file this program maps and updates in place, so a reader
 * sees them at any time without a signal or a pipe (layout: struct stats below, native byte
 * order, u64 each). "ready" on stdout says both sockets are bound: from then on no frame is
 * lost to a late start. The program ends on SIGTERM or SIGINT, and when its parent dies.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
/* A GSO frame is at most 64 KiB of IP packet plus its Ethernet header; room to spare. */
#define FRAME_MAX (65536 + 512)
#define VNET_LEN ((uint32_t)sizeof(struct virtio_net_hdr))
#define WRAP UINT32_MAX
#define STATS_MAGIC 0x676473746c696e31ULL /* "gdstlin1" */
#define QUANTUM_MAX_NS 200000ULL
#define IDLE_NS 2000000ULL

struct direction_stats {
    uint64_t frames, bytes;       /* forwarded: sent on the far side */
    uint64_t dropped_full;        /* the ring or the socket had no room */
    uint64_t dropped_oversize;    /* longer than FRAME_MAX (truncated on read) */
    uint64_t receive_errors;      /* a read failed (e.g. the interface went down) */
    uint64_t send_errors;         /* the far side refused it (e.g. its link is down) */
    uint64_t queued_bytes, queued_bytes_max;
};

struct stats {
    uint64_t magic, delay_ns;
    struct direction_stats dir[2]; /* [0]: A to B, [1]: B to A */
};

struct entry {
    uint64_t due_ns;
    uint32_t len; /* the frame's bytes, virtio header included; WRAP: go back to 0 */
    uint32_t pad;
};

struct ring {
    uint8_t *buf;
    size_t cap, head, tail, count;
};

struct direction {
    int in, out;
    struct ring ring;
    struct direction_stats *stats;
    uint64_t last_due; /* the tail's due time: the ring stays in due order */
};

static volatile sig_atomic_t stopping;

static void on_signal(int signum) {
    (void)signum;
    stopping = 1;
}

static uint64_t ns_of(const struct timespec *t) {
    return (uint64_t)t->tv_sec * 1000000000ULL + (uint64_t)t->tv_nsec;
}

static uint64_t clock_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return ns_of(&t);
}

static uint64_t now_ns(void) {
    return clock_ns(CLOCK_MONOTONIC);
}

static void die(const char *what) {
    fprintf(stderr, "delay_line: %s: %s\n", what, strerror(errno));
    exit(1);
}

static size_t entry_size(uint32_t len) {
    return (sizeof(struct entry) + len + 15) & ~(size_t)15; /* entries stay 16-byte aligned */
}

/* Where a new entry of `need` bytes goes, or NULL if the ring has no room. Entries never
 * straddle the end: one that does not fit there starts again at 0 behind a WRAP marker. */
static struct entry *ring_reserve(struct ring *r, size_t need) {
    if (r->count == 0)
        r->head = r->tail = 0;
    if (r->count == 0 || r->tail > r->head) {
        if (r->cap - r->tail >= need)
            return (struct entry *)(r->buf + r->tail);
        if (r->head <= need) /* strictly more room than need, so that tail never meets head */
            return NULL;
        if (r->cap - r->tail >= sizeof(struct entry))
            ((struct entry *)(r->buf + r->tail))->len = WRAP;
        r->tail = 0;
        return (struct entry *)r->buf;
    }
    return r->head - r->tail > need ? (struct entry *)(r->buf + r->tail) : NULL;
}

static struct entry *ring_head(struct ring *r) {
    if (r->count == 0)
        return NULL;
    if (r->cap - r->head < sizeof(struct entry) ||
        ((struct entry *)(r->buf + r->head))->len == WRAP)
        r->head = 0;
    return (struct entry *)(r->buf + r->head);
}

static int open_socket(const char *ifname) {
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
    if (fd < 0)
        die("socket(AF_PACKET)");
    int one = 1, big = 32 << 20;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0)
        die("PACKET_VNET_HDR");
    /* What we send on this interface would otherwise come back to us as PACKET_OUTGOING. */
    if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0)
        die("PACKET_IGNORE_OUTGOING");
    /* When the kernel took the frame: its due time, however late we read it. */
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) < 0)
        die("SO_TIMESTAMPNS");
    /* Straight to the veth, past its qdisc (noqueue): for up to a second after a link comes
     * up, its qdisc is still the kernel's placeholder, which drops what it is given. */
    if (setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof one) < 0)
        die("PACKET_QDISC_BYPASS");
    /* A burst that arrives while we send must wait in the socket, not be dropped there. */
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big) < 0)
        die("SO_RCVBUFFORCE");
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big) < 0)
        die("SO_SNDBUFFORCE");
    struct sockaddr_ll at = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL)};
    at.sll_ifindex = (int)if_nametoindex(ifname);
    if (at.sll_ifindex == 0)
        die(ifname);
    if (bind(fd, (struct sockaddr *)&at, sizeof at) < 0)
        die("bind");
    return fd;
}

/* When the kernel received msg's frame, on the monotonic clock (`now` if it did not say). */
static uint64_t received_at(struct msghdr *msg, uint64_t now, uint64_t real_minus_mono) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec t;
            memcpy(&t, CMSG_DATA(c), sizeof t);
            uint64_t at = ns_of(&t) - real_minus_mono;
            return at < now ? at : now;
        }
    }
    return now;
}

/* Read every frame waiting on d->in into d's ring, each due `delay` after it arrived. */
static void receive(struct direction *d, uint8_t *staging, uint64_t delay) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    static char control[BATCH][CMSG_SPACE(sizeof(struct timespec))];
    for (;;) {
        memset(msgs, 0, sizeof msgs);
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = staging + (size_t)i * FRAME_MAX;
            iov[i].iov_len = FRAME_MAX;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_control = control[i];
            msgs[i].msg_hdr.msg_controllen = sizeof control[i];
        }
        int n = recvmmsg(d->in, msgs, BATCH, MSG_DONTWAIT | MSG_TRUNC, NULL);
        if (n < 0) {
            /* Else a pending socket error (it is cleared by this read) or a frame the kernel
             * could not describe in a virtio header (it is gone): poll says when to go on. */
            if (errno != EAGAIN && errno != EINTR)
                d->stats->receive_errors++;
            return;
        }
        /* Timestamps are on the real-time clock; due times on the monotonic one. */
        uint64_t now = now_ns(), real_minus_mono = clock_ns(CLOCK_REALTIME) - now;
        for (int i = 0; i < n; i++) {
            uint32_t len = msgs[i].msg_len;
            uint64_t due = received_at(&msgs[i].msg_hdr, now, real_minus_mono) + delay;
            if (due < d->last_due)
                due = d->last_due;
            if ((msgs[i].msg_hdr.msg_flags & MSG_TRUNC) || len > FRAME_MAX) {
                d->stats->dropped_oversize++;
                continue;
            }
            size_t need = entry_size(len);
            struct entry *e = ring_reserve(&d->ring, need);
            if (e == NULL) {
                d->stats->dropped_full++;
                continue;
            }
            e->due_ns = d->last_due = due;
            e->len = len;
            memcpy(e + 1, iov[i].iov_base, len);
            d->ring.tail = (size_t)((uint8_t *)e - d->ring.buf) + need;
            d->ring.count++;
            d->stats->queued_bytes += len;
            if (d->stats->queued_bytes > d->stats->queued_bytes_max)
                d->stats->queued_bytes_max = d->stats->queued_bytes;
        }
        if (n < BATCH)
            return;
    }
}

/* Frames the kernel dropped because d's socket was full (PACKET_STATISTICS resets them). */
static void count_socket_drops(struct direction *d) {
    struct tpacket_stats counted;
    socklen_t len = sizeof counted;
    if (getsockopt(d->in, SOL_PACKET, PACKET_STATISTICS, &counted, &len) == 0)
        d->stats->dropped_full += counted.tp_drops;
}

static void pop(struct direction *d, struct entry *e) {
    d->stats->queued_bytes -= e->len;
    d->ring.head = (size_t)((uint8_t *)e - d->ring.buf) + entry_size(e->len);
    d->ring.count--;
}

/* Send d's frames due by `now`, in order. Returns when to look again: the earliest due time
 * left, 0 if none, or in 1 ms if the far side is full (its socket or its device). */
static uint64_t transmit(struct direction *d, uint64_t now) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct entry *batch[BATCH];
    for (;;) {
        /* Gather up to BATCH due entries without popping them: a failed send keeps them. */
        struct ring saved = d->ring;
        int n = 0;
        struct entry *e;
        while (n < BATCH && (e = ring_head(&d->ring)) != NULL && e->due_ns <= now) {
            batch[n] = e;
            iov[n].iov_base = e + 1;
            iov[n].iov_len = e->len;
            memset(&msgs[n], 0, sizeof msgs[n]);
            msgs[n].msg_hdr.msg_iov = &iov[n];
            msgs[n].msg_hdr.msg_iovlen = 1;
            d->ring.head = (size_t)((uint8_t *)e - d->ring.buf) + entry_size(e->len);
            d->ring.count--;
            n++;
        }
        d->ring = saved;
        if (n == 0) {
            e = ring_head(&d->ring);
            return e == NULL ? 0 : e->due_ns;
        }
        int sent = sendmmsg(d->out, msgs, (unsigned)n, MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == ENOBUFS)
                return now + 1000000;
            if (errno == EINTR)
                continue;
            d->stats->send_errors++; /* the first frame was refused: drop it, go on */
            pop(d, batch[0]);
            continue;
        }
        for (int i = 0; i < sent; i++) {
            d->stats->frames++;
            d->stats->bytes += batch[i]->len - VNET_LEN;
            pop(d, batch[i]);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 6) {
        fprintf(stderr, "usage: delay_line IF_A IF_B DELAY_US STATS_FILE [QUEUE_BYTES]\n");
        return 2;
    }
    char *end;
    uint64_t delay = strtoull(argv[3], &end, 10) * 1000ULL;
    size_t queue = argc == 6 ? strtoull(argv[5], NULL, 10) : (size_t)64 << 20;
    if (*end != '\0' || queue < 2 * (size_t)FRAME_MAX) {
        fprintf(stderr, "delay_line: DELAY_US must be whole microseconds and QUEUE_BYTES at "
                        "least %d\n", 2 * FRAME_MAX);
        return 2;
    }
    /* Gone with the harness that started us, even if it was SIGKILLed. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* Wake-ups on time to the microsecond, not the default 50 us of timer slack. */
    prctl(PR_SET_TIMERSLACK, 1000UL);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);

    int fd = open(argv[4], O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, sizeof(struct stats)) < 0)
        die(argv[4]);
    struct stats *stats = mmap(NULL, sizeof *stats, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (stats == MAP_FAILED)
        die("mmap(STATS_FILE)");
    close(fd);
    stats->delay_ns = delay;

    int a = open_socket(argv[1]), b = open_socket(argv[2]);
    struct direction dirs[2] = {{.in = a, .out = b}, {.in = b, .out = a}};
    uint8_t *staging = malloc((size_t)BATCH * FRAME_MAX);
    if (staging == NULL)
        die("malloc");
    for (int i = 0; i < 2; i++) {
        dirs[i].stats = &stats->dir[i];
        dirs[i].ring.cap = queue;
        /* Pages are only touched as the queue grows: an idle line costs no memory. */
        dirs[i].ring.buf = mmap(NULL, queue, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (dirs[i].ring.buf == MAP_FAILED)
            die("mmap(queue)");
    }
    stats->magic = STATS_MAGIC;
    printf("ready\n");
    fflush(stdout);

    uint64_t quantum = delay / 16 < QUANTUM_MAX_NS ? delay / 16 : QUANTUM_MAX_NS;
    uint64_t drops_checked = 0;
    while (!stopping) {
        receive(&dirs[0], staging, delay);
        receive(&dirs[1], staging, delay);
        uint64_t now = now_ns(), next = 0;
        for (int i = 0; i < 2; i++) {
            uint64_t due = transmit(&dirs[i], now + quantum / 2);
            if (due != 0 && (next == 0 || due < next))
                next = due;
        }
        if (now - drops_checked > 100000000ULL) { /* ten times a second is enough */
            count_socket_drops(&dirs[0]);
            count_socket_drops(&dirs[1]);
            drops_checked = now;
        }
        uint64_t wake = 0;
        if (next != 0) {
            wake = next - quantum / 2;
            wake = wake < now + IDLE_NS ? wake : now + IDLE_NS;
        }
        /* Frames queued: arrivals wait in the socket until the wake-up (see the top). */
        short in = next != 0 ? 0 : POLLIN;
        struct pollfd fds[2] = {
            {.fd = a, .events = in},
            {.fd = b, .events = in},
        };
        struct timespec wait, *timeout = NULL;
        if (wake != 0) {
            uint64_t left = wake > now ? wake - now : 0;
            wait.tv_sec = (time_t)(left / 1000000000ULL);
            wait.tv_nsec = (long)(left % 1000000000ULL);
            timeout = &wait;
        }
        if (ppoll(fds, 2, timeout, NULL) < 0 && errno != EINTR)
            die("ppoll");
    }
    return 0;
}
