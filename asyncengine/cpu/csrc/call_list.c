/* Runs a recorded list of kernel calls in one go: a kernel graph's replay (cpu/kernel_graph.py) calls the C
 * kernels from here instead of through ctypes one by one (~1.7 us of Python and libffi a call, ~110 calls a
 * decode step).
 *
 * Every kernel takes only integer-class arguments (pointers, int, long) and float; the System V x86-64 and
 * AArch64 (Linux) calling conventions assign each class its own registers in order (then 8-byte stack
 * slots for integers, in order), so calling any of them through one prototype of MAX_INTS longs and
 * MAX_FLOATS floats passes every argument where the kernel reads it; the extra ones are ignored (the caller
 * pops them). cpu/kernel_graph.py records a call here only on those platforms and for kernels whose
 * argtypes and restype it knows; anything else replays through ctypes. */
#include <stdint.h>

#define MAX_INTS 24
#define MAX_FLOATS 4

typedef struct {
    void *fn;
    int64_t ints[MAX_INTS];
    float floats[MAX_FLOATS];
    int32_t check; /* 0: no result (void); 4: an int to compare; 8: a long */
    int32_t pad;
    int64_t expect; /* the result recorded at capture */
    int64_t got; /* written where a result differs */
} Call;

typedef int64_t (*generic_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float,
                              float);

int call_list_layout(void) { return (int)sizeof(Call); }

/* Returns 0, or 1 + the index of the first call whose result differs from the recorded one (the rest are
 * not run). */
long run_call_list(Call *calls, long n) {
    for (long i = 0; i < n; i++) {
        Call *c = calls + i;
        const int64_t *a = c->ints;
        const float *f = c->floats;
        const int64_t r = ((generic_fn)c->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                              a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18],
                                              a[19], a[20], a[21], a[22], a[23], f[0], f[1], f[2], f[3]);
        if ((c->check == 4 && (int32_t)r != (int32_t)c->expect) || (c->check == 8 && r != c->expect)) {
            c->got = c->check == 4 ? (int32_t)r : r;
            return i + 1;
        }
    }
    return 0;
}
