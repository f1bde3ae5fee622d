// The CPU decode's arithmetic ceiling, per core: how many 512-bit vdpbf16ps (the AVX-512 bf16 path's only product,
// 32 bf16 multiply-adds into 16 float32 lanes) and vfmadd231ps a core issues per second and per cycle, with 12
// independent accumulators (more than latency x throughput), their latency (one dependent chain), and the clock
// (a chain of dependent integer adds, one per cycle). Single-threaded; run it on an idle core.
//
//     gcc -O2 -o /tmp/dot_peak bench/dot_peak.c && /tmp/dot_peak
//
// What the figures bound (bench/LOG.md, issue 24 §3): a bfloat16 decode row on the AVX-512 bf16 path costs
// 3 * head_dim / 32 vdpbf16ps per (query head, key token): head_dim / 32 for q . k, and 2 * head_dim / 32 for
// p * v (two bf16 terms of p, hi and lo, per token pair; see csrc/cpu/avx512_kernels.h). Reading a shared block
// once saves its loads, not these products: every row still multiplies its own query by the shared keys. So a
// batch of R rows x H heads x T tokens needs at least 3 * head_dim / 32 * R * H * T / (cores * peak) seconds.
// The instructions are in inline assembly (the compiler neither folds nor reorders them) and need AVX512_BF16;
// without it the program says so and exits.
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void update(double* best, double start) {  // the best time so far of a loop that began at start
  const double elapsed = now() - start;
  if (elapsed < *best) *best = elapsed;
}

#define DP(i) "vdpbf16ps %%zmm20, %%zmm21, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm20, %%zmm21, %%zmm" #i "\n\t"
#define TWELVE(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define CHAIN(OP) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0) OP(0)

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    printf("this CPU has no AVX512_BF16\n");
    return 1;
  }
  const long n = 50000000;  // loop iterations, 12 instructions each
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  for (int repeat = 0; repeat < 5; ++repeat) {  // the best of 5: the machine is shared
    double t = now();
    for (long k = 0; k < n; ++k) __asm__ volatile("add $1, %%rax\n\tadd $1, %%rax\n\tadd $1, %%rax\n\t"
                                                  "add $1, %%rax\n\tadd $1, %%rax\n\tadd $1, %%rax\n\t"
                                                  "add $1, %%rax\n\tadd $1, %%rax\n\tadd $1, %%rax\n\t"
                                                  "add $1, %%rax\n\tadd $1, %%rax\n\tadd $1, %%rax\n\t" ::: "rax");
    update(&best[0], t);
    t = now();
    for (long k = 0; k < n; ++k) __asm__ volatile(TWELVE(DP)::: "memory");
    update(&best[1], t);
    t = now();
    for (long k = 0; k < n; ++k) __asm__ volatile(TWELVE(FMA)::: "memory");
    update(&best[2], t);
    t = now();
    for (long k = 0; k < n; ++k) __asm__ volatile(CHAIN(DP)::: "memory");
    update(&best[3], t);
  }
  const double count = 12.0 * n, ghz = count / best[0] / 1e9;
  printf("clock (dependent integer adds): %.2f GHz\n", ghz);
  printf("vdpbf16ps zmm, 12 chains: %.2f G/s per core, %.2f per cycle\n", count / best[1] / 1e9,
         count / best[1] / 1e9 / ghz);
  printf("vfmadd231ps zmm, 12 chains: %.2f G/s per core, %.2f per cycle\n", count / best[2] / 1e9,
         count / best[2] / 1e9 / ghz);
  printf("vdpbf16ps zmm latency (one chain): %.1f cycles\n", best[3] / count * ghz * 1e9);
  return 0;
}
