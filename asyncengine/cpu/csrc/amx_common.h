/* What the AMX kernels (amx_gemm.c, amx_attention.c) share: asking Linux for the tile state, and the
 * tile configuration both use. Included only where the build has AMX; cpu/build.py hashes this file into
 * every library's cache key. */
#ifndef ASYNCENGINE_AMX_COMMON_H
#define ASYNCENGINE_AMX_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE 512 /* bfloat16 per 1 KiB tile */

/* Linux hands out AMX's tile state only to processes that ask for it (once per process). */
static inline int request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: float32 accumulators; 4, 5: A operands of `rows` rows; 6, 7: B operands (16 rows). Every
 * row 64 bytes. */
static inline void configure_tiles(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t >= 6 ? 16 : rows;
    }
    /* Not the _tile_loadconfig intrinsic: GCC's tells the compiler that ldtilecfg reads 8 bytes at &c, so
     * the stores of colsb and rows can be dropped as dead or c's slot reused for other locals first (seen
     * at -O3: ldtilecfg then faults on a config whose widths read zero). "m" on the whole struct says it
     * reads all 64 bytes. */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

#endif
