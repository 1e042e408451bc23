// MOK_HD marks functions shared by the host and device code paths (schedule, ring, transport).
#pragma once

// Under nvcc (and clang's CUDA mode) these functions compile for both sides; a plain C++
// compiler sees ordinary functions, so the CPU backend runs the very same code.
#if defined(__CUDACC__)
#define MOK_HD __host__ __device__
#else
#define MOK_HD
#endif
