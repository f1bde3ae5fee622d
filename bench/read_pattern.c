// How fast can this machine read a paged KV cache, with and without arithmetic? (x86-64 with AVX-512F)
//
// Two regions (keys, values) of num_blocks blocks of 32 KiB each (a block of 16 tokens x 8 kv heads x 128 dims
// in bfloat16) are visited in a shuffled order (or in order), split evenly over the OpenMP threads, as the CPU
// paged_attention kernel visits them. Per block: 128 steps, each reading 256 bytes of keys and 256 bytes of
// values (one key row and one value row) and issuing `fmas` 512-bit FMAs in 8 independent chains, while the next
// block's lines are prefetched as far ahead as the step reads (4 per region). Prints the bytes read per second
// (best and mean of the repeats). Compare with x.sum() over a large tensor, measured in the same minutes.
//
//   gcc -O2 -fopenmp -o /tmp/read_pattern bench/read_pattern.c
//   GOMP_SPINCOUNT=0 OMP_NUM_THREADS=2 /tmp/read_pattern [num_blocks=8192] [fmas=0] [shuffle=1]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kBlockBytes = 32768, kStepBytes = 256, kSteps = kBlockBytes / kStepBytes, kRepeats = 7 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) static __m512 read_step(const char* p, __m512 acc) {
  for (int i = 0; i < kStepBytes; i += 64) acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(p + i)));
  return acc;
}

// Visits blocks order[begin, end) of keys and values; returns something that depends on every byte read.
__attribute__((target("avx512f"))) static float visit(const char* keys, const char* values, const int* order,
                                                      int begin, int end, int fmas) {
  __m512 acc = _mm512_setzero_ps(), chain[8];
  for (int j = 0; j < 8; ++j) chain[j] = _mm512_set1_ps((float)j);
  const __m512 decay = _mm512_set1_ps(0.999f);
  for (int b = begin; b < end; ++b) {
    const char* k = keys + (size_t)order[b] * kBlockBytes;
    const char* v = values + (size_t)order[b] * kBlockBytes;
    const char* next_k = b + 1 < end ? keys + (size_t)order[b + 1] * kBlockBytes : NULL;
    const char* next_v = b + 1 < end ? values + (size_t)order[b + 1] * kBlockBytes : NULL;
    for (int s = 0; s < kSteps; ++s) {
      if (next_k) {
        for (int line = 0; line < kStepBytes / 64; ++line) {
          __builtin_prefetch(next_k + s * kStepBytes + line * 64, 0, 0);
          __builtin_prefetch(next_v + s * kStepBytes + line * 64, 0, 0);
        }
      }
      acc = read_step(k + s * kStepBytes, acc);
      acc = read_step(v + s * kStepBytes, acc);
      for (int i = 0; i < fmas; i += 8)
        for (int j = 0; j < 8; ++j) chain[j] = _mm512_fmadd_ps(chain[j], decay, acc);
    }
  }
  for (int j = 0; j < 8; ++j) acc = _mm512_add_ps(acc, chain[j]);
  float lanes[16];
  _mm512_storeu_ps(lanes, acc);
  return lanes[0];
}

int main(int argc, char** argv) {
  const int num_blocks = argc > 1 ? atoi(argv[1]) : 8192;
  const int fmas = argc > 2 ? atoi(argv[2]) : 0;
  const int shuffle = argc > 3 ? atoi(argv[3]) : 1;
  const size_t bytes = (size_t)num_blocks * kBlockBytes;
  char* keys = aligned_alloc(4096, bytes);
  char* values = aligned_alloc(4096, bytes);
  int* order = malloc(num_blocks * sizeof(int));
  if (!keys || !values || !order) return 1;
  memset(keys, 1, bytes);
  memset(values, 1, bytes);
  for (int i = 0; i < num_blocks; ++i) order[i] = i;
  srand(1);
  for (int i = num_blocks - 1; shuffle && i > 0; --i) {
    const int j = rand() % (i + 1), t = order[i];
    order[i] = order[j], order[j] = t;
  }
  double best = 1e30, total = 0;
  float sink = 0;
  for (int rep = 0; rep < kRepeats + 2; ++rep) {  // the first two are warm-up
    const double start = now();
#pragma omp parallel reduction(+ : sink)
    {
      const int n = omp_get_num_threads(), id = omp_get_thread_num();
      sink += visit(keys, values, order, num_blocks * id / n, num_blocks * (id + 1) / n, fmas);
    }
    const double t = now() - start;
    if (rep >= 2) best = t < best ? t : best, total += t;
  }
  printf("%d blocks of 32 KiB x 2, %s, %d FMAs per 512 B, %d threads: best %.1f GB/s, mean %.1f GB/s (%g)\n",
         num_blocks, shuffle ? "shuffled" : "in order", fmas, omp_get_max_threads(), 2.0 * bytes / best / 1e9,
         2.0 * bytes * kRepeats / total / 1e9, sink);
  return 0;
}
