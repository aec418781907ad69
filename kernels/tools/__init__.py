"""Developer tools for trillm.kernels, not used at run time: offline compile checks and the GPU check.

`cuda_compile` (nvcc on MLX's generated CUDA wrapper), `metal_compile` (xcrun on a Mac; a g++ stand-in check
anywhere), `variants` (the kernel variants model shapes launch, recorded from the launch code) and
`gpu_check.sh` (self-check, kernel tests and benchmark as one script for a GPU machine). May import
trillm.kernels; nothing imports this package but tests and the scripts.
"""
