// safetensors files: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then
// the tensor bytes. The reader checks every field against the file and says what is wrong.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

class SafetensorsFile {
 public:
  static Result<SafetensorsFile> open(const std::string& path);
  // `origin` names the bytes in error messages (a path, "<memory>").
  static Result<SafetensorsFile> parse(const std::vector<uint8_t>& bytes, const std::string& origin);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // A view of a tensor's bytes (valid while this file lives); nullopt if absent.
  std::optional<Tensor> tensor(const std::string& name) const;

 private:
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<Buffer> data_;  // the data section, aligned
};

// Tensors (host, contiguous) and string metadata as safetensors bytes / into a file.
Result<std::vector<uint8_t>> serialize_safetensors(
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata);
Status write_safetensors(const std::string& path,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata);

}  // namespace epmoe
