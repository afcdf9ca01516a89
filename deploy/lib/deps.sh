# Sourced by tests/run.sh and deploy/demo.sh: installs the Debian packages
# Canzona builds and tests with, only those missing, quietly.
# The CUDA 13 toolkit is expected in /usr/local/cuda (not a Debian package).

CANZONA_DEBIAN_PACKAGES=(
  cmake ninja-build g++ pkg-config
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev liblapacke-dev
  nlohmann-json3-dev libspdlog-dev libcli11-dev
  libgloo-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  # The TLS tests make a throwaway CA and server certificate with its CLI.
  openssl
  prometheus libcivetweb-dev
  libsystemd-dev systemd yamllint python3-yaml
  # The Python package (pure Python over grpcio) and its tests: Debian's
  # interpreter, its gRPC and protobuf, setuptools, wheel, pip and venv (the
  # test that pip-installs the package into a fresh venv offline), torch
  # (CPU), numpy, pytest.
  python3-grpcio python3-protobuf python3-setuptools python3-wheel python3-pip
  python3-venv
  python3-torch python3-numpy python3-pytest
  # The GPU bundle (tests/gpu/bundle): RPATHs, the archive, and the bare
  # Debian chroot of tests/run.sh's bundle stage.
  patchelf xz-utils debootstrap
  # The HTML plan report's test (tests/unit/ctl): a headless browser and
  # the PNG reader that checks its screenshots.
  chromium python3-pil
  # tests/run.sh's sanitizer stage: clang 14, its ASan/UBSan/LSan and
  # libFuzzer runtimes (libclang_rt.*, FuzzedDataProvider.h), and
  # llvm-symbolizer for symbolized reports.
  clang libclang-rt-14-dev llvm
)

canzona_install_deps() {
  local missing=()
  local pkg
  for pkg in "${CANZONA_DEBIAN_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed"; then
      missing+=("$pkg")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  echo "canzona: installing ${missing[*]}" >&2
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >/dev/null
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Adds /usr/local/cuda/bin to PATH so CMake finds nvcc when it exists.
canzona_cuda_path() {
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
}
