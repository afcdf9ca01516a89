// Default sanitizer runtime options, linked into every executable of a
// CANZONA_SANITIZE build (top-level CMakeLists.txt). The runtimes call these
// hooks at startup before reading ASAN_OPTIONS / LSAN_OPTIONS /
// UBSAN_OPTIONS, so a plain `ctest` (and gtest discovery at build time) in a
// sanitizer tree gets leak checking and the suppression files, and anything
// set in the environment still overrides a flag here.
//
// The suppression files list reports inside Debian's uninstrumented system
// libraries (gRPC, protobuf, abseil, Gloo) only, never our own code.
//
// Thread-safety: the functions return string literals; the runtimes call
// them during initialization.

#ifndef CANZONA_SANITIZER_DIR
#error "CANZONA_SANITIZER_DIR must name tests/sanitizers"
#endif

extern "C" {

// Weak in the runtimes; a definition here takes precedence.
// allocator_may_return_null: huge requests fail as malloc does (the cpu
// backend's Allocate() reports them as RESOURCE_EXHAUSTED, and its test
// checks that) instead of ASan aborting the process.
const char* __asan_default_options() {
  return "detect_leaks=1:"
         "allocator_may_return_null=1:"
         "check_initialization_order=1:"
         "detect_stack_use_after_return=0:"
         "suppressions=" CANZONA_SANITIZER_DIR "/asan.supp";
}

const char* __lsan_default_options() {
  return "suppressions=" CANZONA_SANITIZER_DIR "/lsan.supp";
}

// With -fno-sanitize-recover=undefined every UBSan report aborts; runtime
// suppressions cannot apply to non-recoverable checks, so the system
// headers are excluded at compile time instead (ignorelist.txt).
const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1";
}

}  // extern "C"
