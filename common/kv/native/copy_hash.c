/* A hand-off's land as one foreign call: copy a piece chunk by chunk and feed each chunk of the destination to XXH3's
 * streaming update right after it is written, while it is still in the core's cache (common/kv/xxh3.py,
 * Stream.copy_update). The update is the xxhash package's own C function, passed in by address, so the digest is the
 * package's. In Python the same loop made two ctypes calls per chunk, and between them each landing thread took the
 * GIL back: with two threads landing at once they queued for it 256 times per 64 MB (see xxh3.py for the figures).
 *
 * Returns 0, or the update's first nonzero status (the chunks after it are neither copied nor hashed).
 */
#include <stddef.h>
#include <string.h>

typedef int (*xxh3_update_fn)(void *state, const void *input, size_t length);

int copy_hash(void *dst, const void *src, size_t size, size_t chunk, void *state, xxh3_update_fn update) {
    char *to = dst;
    const char *from = src;
    for (size_t at = 0; at < size; at += chunk) {
        const size_t n = size - at < chunk ? size - at : chunk;
        memmove(to + at, from + at, n); /* (as the Python loop it replaces: overlapping pieces stay defined) */
        const int status = update(state, to + at, n);
        if (status) return status;
    }
    return 0;
}
