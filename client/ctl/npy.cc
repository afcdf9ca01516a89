#include "client/ctl/npy.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/ctl/atomic_file.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

// A cursor over the header's Python dict literal.
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& text) : text_(text) {}

  absl::StatusOr<NpyHeader> Parse() {
    NpyHeader header;
    bool have_descr = false, have_order = false, have_shape = false;
    CANZONA_RETURN_IF_ERROR(Expect('{'));
    while (true) {
      SkipSpace();
      if (Peek() == '}') {
        ++pos_;
        break;
      }
      CANZONA_ASSIGN_OR_RETURN(std::string key, ParseString());
      CANZONA_RETURN_IF_ERROR(Expect(':'));
      if (key == "descr") {
        CANZONA_ASSIGN_OR_RETURN(header.descr, ParseString());
        have_descr = true;
      } else if (key == "fortran_order") {
        CANZONA_ASSIGN_OR_RETURN(header.fortran_order, ParseBool());
        have_order = true;
      } else if (key == "shape") {
        CANZONA_ASSIGN_OR_RETURN(header.shape, ParseTuple());
        have_shape = true;
      } else {
        return Error(absl::StrCat("unexpected key '", key, "'"));
      }
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
      } else if (Peek() != '}') {
        return Error("expected ',' or '}'");
      }
    }
    if (!have_descr || !have_order || !have_shape) {
      return Error("missing 'descr', 'fortran_order' or 'shape'");
    }
    return header;
  }

 private:
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void SkipSpace() {
    while (pos_ < text_.size() &&
           std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed header at offset ", pos_, ": ", what));
  }
  absl::Status Expect(char c) {
    SkipSpace();
    if (Peek() != c)
      return Error(absl::StrCat("expected '", std::string(1, c), "'"));
    ++pos_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ParseString() {
    SkipSpace();
    char quote = Peek();
    if (quote != '\'' && quote != '"') return Error("expected a quoted string");
    size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string::npos) return Error("unterminated string");
    std::string value = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return value;
  }
  absl::StatusOr<bool> ParseBool() {
    SkipSpace();
    if (text_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (text_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    return Error("expected True or False");
  }
  absl::StatusOr<std::vector<int64_t>> ParseTuple() {
    CANZONA_RETURN_IF_ERROR(Expect('('));
    std::vector<int64_t> dims;
    while (true) {
      SkipSpace();
      if (Peek() == ')') {
        ++pos_;
        return dims;
      }
      if (!std::isdigit(static_cast<unsigned char>(Peek()))) {
        return Error("expected a non-negative dimension");
      }
      int64_t value = 0;
      while (std::isdigit(static_cast<unsigned char>(Peek()))) {
        if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) {
          return Error("dimension too large");
        }
        value = value * 10 + (text_[pos_++] - '0');
      }
      // Python writes 3-D shapes as (2, 3, 4) and 1-D as (5,); a trailing
      // 'L' appears in files written by Python 2.
      if (Peek() == 'L') ++pos_;
      dims.push_back(value);
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
      } else if (Peek() != ')') {
        return Error("expected ',' or ')' in shape");
      }
    }
  }

  const std::string& text_;
  size_t pos_ = 0;
};

absl::Status WithPath(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(path, ": ", status.message()));
}

}  // namespace

absl::StatusOr<NpyHeader> ParseNpyHeader(const std::string& header) {
  return HeaderParser(header).Parse();
}

absl::StatusOr<NpyArray> ReadNpyAsFloat32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)),
                    std::istreambuf_iterator<char>());
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a valid .npy file: ", what));
  };
  if (bytes.size() < kMagicSize + 4 ||
      bytes.compare(0, kMagicSize, kMagic, kMagicSize) != 0) {
    return invalid("bad magic (expected \\x93NUMPY)");
  }
  const auto major = static_cast<unsigned char>(bytes[kMagicSize]);
  size_t header_len = 0;
  size_t header_start = 0;
  auto byte = [&](size_t i) {
    return static_cast<size_t>(static_cast<unsigned char>(bytes[i]));
  };
  if (major == 1) {
    header_len = byte(8) | (byte(9) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return invalid("truncated header");
    header_len = byte(8) | (byte(9) << 8) | (byte(10) << 16) | (byte(11) << 24);
    header_start = 12;
  } else {
    return invalid(absl::StrCat("unsupported format version ", major));
  }
  if (bytes.size() < header_start + header_len)
    return invalid("truncated header");
  absl::StatusOr<NpyHeader> header =
      ParseNpyHeader(bytes.substr(header_start, header_len));
  if (!header.ok()) return WithPath(path, header.status());

  if (header->fortran_order) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": Fortran-order arrays are not supported (save a C-order "
                     "array, e.g. numpy.ascontiguousarray)"));
  }
  size_t item_size = 0;
  if (header->descr == "<f4") {
    item_size = 4;
  } else if (header->descr == "<f8") {
    item_size = 8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": dtype '", header->descr,
                     "' is not supported (expected float32 '<f4' or float64 "
                     "'<f8')"));
  }
  int64_t numel = 1;
  for (int64_t d : header->shape) {
    if (d != 0 && numel > std::numeric_limits<int64_t>::max() / 8 / d) {
      return invalid("shape too large");
    }
    numel *= d;
  }
  const size_t data_start = header_start + header_len;
  const size_t expected = static_cast<size_t>(numel) * item_size;
  if (bytes.size() - data_start != expected) {
    return invalid(
        absl::StrCat("data is ", bytes.size() - data_start, " bytes, shape (",
                     absl::StrJoin(header->shape, ", "), ") needs ", expected));
  }
  NpyArray array;
  array.shape = header->shape;
  array.source_dtype = header->descr;
  array.data.resize(static_cast<size_t>(numel));
  const char* src = bytes.data() + data_start;
  if (item_size == 4) {
    std::memcpy(array.data.data(), src, expected);
  } else {
    for (int64_t i = 0; i < numel; ++i) {
      double value;
      std::memcpy(&value, src + i * 8, 8);
      array.data[static_cast<size_t>(i)] = static_cast<float>(value);
    }
  }
  return array;
}

absl::Status WriteNpyFloat32(const std::string& path,
                             absl::Span<const int64_t> shape,
                             absl::Span<const float> data) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("npy: negative dimension");
    numel *= d;
  }
  if (numel != static_cast<int64_t>(data.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: ", data.size(), " values do not fill shape (",
                     absl::StrJoin(shape, ", "), ")"));
  }
  std::string shape_text = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) shape_text += ",";
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (",
                   shape_text, "), }");
  // Pad with spaces so the data starts at a multiple of 64 bytes; the
  // header ends with a newline, as numpy writes it.
  const size_t unpadded = kMagicSize + 2 + 2 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes(kMagic, kMagicSize);
  bytes.push_back('\x01');
  bytes.push_back('\x00');
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>((header.size() >> 8) & 0xff));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(data.data()), data.size() * 4);

  return WriteFileAtomically(path, bytes);
}

}  // namespace canzona
