/* A stand-in libcuda.so.1 for the Mooncake test on a machine without the NVIDIA driver
 * (.ci/run's Mooncake step builds it: cc -shared -fPIC -Wl,-soname,libcuda.so.1). The
 * mooncake-transfer-engine-cuda13 0.3.14 wheel links libcuda lazily and, over TCP, calls none
 * of it; these are the cu* symbols its store module names, each answering
 * CUDA_ERROR_NO_DEVICE (100), so that a call made anyway fails cleanly instead of the loader
 * refusing the module. Never on the loader path of anything that wants a GPU. */
#define NO_DEVICE(name) int name(void) { return 100; }
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetPCIBusId)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuInit)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLaunchKernelEx)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoadDataEx)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)

static const char no_driver[] = "no CUDA driver (v4pool's test stub)";
int cuGetErrorName(int e, const char **s) { (void)e; if (s) *s = no_driver; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; if (s) *s = no_driver; return 0; }
