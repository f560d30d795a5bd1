// The AMX kernels on software tiles: moe_amx.cpp compiled again with HINA_AMX_SOFTWARE_TILES
// (kernels/amx/tiles.h), entry points get_kernels_amx_sw / get_qkernels_amx_sw. Built into the
// C++ tests' core only (CMakeLists.txt: never the Python module); there,
// hina::use_amx_software_tiles(true) makes the amx tier run these on CPUs without AMX, so the
// kernels' code is tested against the generic twin on every AVX-512 machine. Slow: for tests.
#define HINA_AMX_SOFTWARE_TILES 1
#include "kernels/amx/moe_amx.cpp"
