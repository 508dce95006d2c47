// The fixed tree that ends every 8-strided float32 sum in our kernels: a row's bits must depend on that row alone, so
// the order of the last additions is fixed here rather than left to the compiler or the thread split.
#pragma once

inline float tree8(const float p[8]) { return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])); }
