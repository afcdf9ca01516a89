# Sourced by make_bundle.sh (what to pack) and check_bundle.sh (what to
# verify): which shared libraries the bundle leaves to the target machine,
# and the ELF questions both ask. Needs readelf (binutils) and ldd.
#
#   source tests/gpu/bundle/elf_closure.sh
#   canzona_is_elf FILE               # 0 for an ELF file
#   canzona_needed FILE               # its DT_NEEDED sonames, one a line
#   canzona_rpath FILE                # its DT_RPATH / DT_RUNPATH
#   canzona_lib_class SONAME          # glibc | cuda | bundled
#   canzona_resolve CLASS FILE...     # "soname path" of every library of
#                                     # that class the files load (ldd,
#                                     # transitive); fails when a bundled-
#                                     # class library is "not found"

# glibc's own libraries: every Linux target has them, matched to its loader.
canzona_glibc_pattern='^(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libBrokenLocale|libnss_[a-z_]+|libthread_db|libc_malloc_debug|libmemusage|libpcprofile|libSegFault)\.so(\.[0-9]+)*$|^ld-linux(-x86-64)?\.so\.[0-9]+$|^linux-vdso\.so\.1$'
# The CUDA runtime and math libraries, NCCL and the driver: hundreds of MiB,
# found on the target (the runner searches for them).
canzona_cuda_pattern='^lib(cuda|cudart|cublas|cublasLt|cusolver|cusolverMg|cusparse|cusparseLt|cufft|cufftw|curand|nvJitLink|nvrtc|nvrtc-builtins|nccl|nvidia-[a-z0-9_-]+|nvToolsExt|cupti)\.so(\.[0-9]+)*$'

canzona_is_elf() {
  [[ -f "$1" ]] && [[ "$(head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" == '177ELF' ]]
}

canzona_needed() {
  readelf -d --wide "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'
}

canzona_rpath() {
  readelf -d --wide "$1" 2>/dev/null | sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]/\2/p'
}

canzona_lib_class() {
  if [[ "$1" =~ $canzona_glibc_pattern ]]; then
    echo glibc
  elif [[ "$1" =~ $canzona_cuda_pattern ]]; then
    echo cuda
  else
    echo bundled
  fi
}

canzona_resolve() {
  local class="$1" file line soname path failed=0 found=()
  shift
  for file in "$@"; do
    while IFS= read -r line; do
      if [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+not\ found ]]; then
        soname="${BASH_REMATCH[1]}"
        if [[ "$(canzona_lib_class "$soname")" == bundled ]]; then
          echo "canzona_resolve: $file: $soname not found" >&2
          failed=1
        fi
      elif [[ "$line" =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+(/[^[:space:]]+) ]]; then
        soname="${BASH_REMATCH[1]}"
        path="${BASH_REMATCH[2]}"
        [[ "$(canzona_lib_class "$soname")" == "$class" ]] && found+=("$soname $path")
      fi
    done < <(ldd "$file" 2>/dev/null)
  done
  ((${#found[@]} == 0)) || printf '%s\n' "${found[@]}" | sort -u
  return "$failed"
}
