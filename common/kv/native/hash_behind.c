/* A landing's checksum computed behind the transfer, in one foreign call that never takes the GIL back
 * (common/kv/hash_behind.py). The caller lists the landing's pieces up front, already cut at the checksum's segment
 * boundaries (common/kv/digest.py); the transfer's thread then publishes how many of them have landed
 * (hash_behind_publish), and this loop hashes each piece as soon as it is published — while it is still in cache —
 * writing one XXH3-64 digest per segment. NIXL's transfer() holds the GIL while UCX copies inside it: a hashing
 * thread that returned to Python between pieces waited for the GIL behind every post, and the hash ran after the
 * copy instead of beside it.
 *
 * The XXH3 functions are the xxhash package's own, passed by address, so the digests are the package's.
 * Returns the number of digests written; -1 when the landing was aborted (HASH_BEHIND_ABORTED published) before every
 * piece was hashed; -2 when XXH3's reset or update failed; -3 when no piece came for timeout_ns (a caller that never
 * published the rest nor aborted: the thread is not kept for ever).
 */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int (*xxh3_update_fn)(void *state, const void *input, size_t length);
typedef int (*xxh3_reset_fn)(void *state);
typedef uint64_t (*xxh3_digest_fn)(void *state);

#define HASH_BEHIND_ABORTED ((size_t)-1)

void hash_behind_publish(size_t *ready, size_t value) { __atomic_store_n(ready, value, __ATOMIC_RELEASE); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

long hash_behind(const uintptr_t *addrs, const size_t *lens, const unsigned char *ends, size_t n, const size_t *ready,
                 int64_t timeout_ns, void *state, xxh3_update_fn update, xxh3_reset_fn reset, xxh3_digest_fn digest,
                 uint64_t *digests) {
    /* (a short nap, not a spin: on two cores a spinning hasher takes the core the transfer's progress needs) */
    const struct timespec nap = {0, 20000};
    long written = 0;
    if (reset(state)) return -2;
    for (size_t i = 0; i < n; i++) {
        size_t upto;
        const int64_t give_up = now_ns() + timeout_ns;
        while ((upto = __atomic_load_n(ready, __ATOMIC_ACQUIRE)) <= i) {
            if (now_ns() > give_up) return -3;
            nanosleep(&nap, NULL);
        }
        if (upto == HASH_BEHIND_ABORTED) return -1;
        if (lens[i] && update(state, (const void *)addrs[i], lens[i])) return -2;
        if (ends[i]) {
            digests[written++] = digest(state);
            if (reset(state)) return -2;
        }
    }
    return written;
}
