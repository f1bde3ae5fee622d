// The largest relative error of the CPU kernels' exponential (exp_nonpositive, csrc/cpu/avx512_kernels.h: the
// AVX-512 softmax of the decode and prefill kernels), against exp in double, over every float x in [-1, 0] and in
// [-87, 0] (below -87 the result leaves float32's normal range and the kernel flushes it to 0), and its value at 0.
// The same operations in scalar float32 (fmaf, one rounding per step, as _mm512_fmadd_ps): keep the constants
// equal to the kernel's. Takes about a minute and a half on one core.
//
//     gcc -O2 -ffp-contract=off -o /tmp/exp_error bench/exp_error.c -lm && /tmp/exp_error
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static float exp_nonpositive(float x) {  // 2^n * 2^f, n = round(x log2 e), |f| <= 1/2
  const float y = fmaxf(-200.f, x * 1.44269504f);
  const float n = rintf(y), f = y - n;
  float poly = 1.3266980e-3f;
  poly = fmaf(poly, f, 9.6754692e-3f);
  poly = fmaf(poly, f, 5.5507425e-2f);
  poly = fmaf(poly, f, 2.4022122e-1f);
  poly = fmaf(poly, f, 6.9314694e-1f);
  poly = fmaf(poly, f, 1.f);
  return ldexpf(poly, (int)n);
}

static void worst_over(float lowest) {  // every float in [lowest, 0], by bit pattern from -0 down
  uint32_t first, last;
  const float zero = -0.f;
  memcpy(&first, &zero, 4);
  memcpy(&last, &lowest, 4);
  double worst = 0, worst_x = 0;
  for (uint32_t bits = first; bits <= last; ++bits) {
    float x;
    memcpy(&x, &bits, 4);
    const double want = exp((double)x);
    const double error = fabs((double)exp_nonpositive(x) - want) / want;
    if (error > worst) worst = error, worst_x = x;
  }
  printf("[%g, 0]: largest relative error %.3g (at x = %.9g)\n", lowest, worst, worst_x);
}

int main(void) {
  printf("exp(0) = %.9g\n", exp_nonpositive(0.f));
  worst_over(-1.f);
  worst_over(-87.f);
  return 0;
}
