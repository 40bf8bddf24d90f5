#include "epmoe/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace epmoe {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100u << 20;

constexpr std::pair<DType, const char*> kDTypeNames[] = {
    {DType::kF32, "F32"},     {DType::kBF16, "BF16"}, {DType::kF16, "F16"},
    {DType::kFP8E4M3, "F8_E4M3"}, {DType::kI32, "I32"}, {DType::kI64, "I64"}};

std::optional<DType> parse_dtype(const std::string& name) {
  for (const auto& [dtype, text] : kDTypeNames)
    if (name == text) return dtype;
  return std::nullopt;
}

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& [entry, text] : kDTypeNames)
    if (entry == dtype) return text;
  return "?";
}

Status malformed(const std::string& origin, const std::string& what, const std::string& expected,
                 const std::string& given) {
  return bad_argument(origin + ": " + what, expected, given);
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Result<Entry> parse_entry(const std::string& origin, const std::string& name, const json& value) {
  const std::string where = "tensor '" + name + "'";
  if (!value.is_object()) return malformed(origin, where, "an object", value.type_name());
  if (!value.contains("dtype") || !value["dtype"].is_string())
    return malformed(origin, where + " dtype", "a string", value.contains("dtype") ? value["dtype"].dump() : "nothing");
  Entry entry{name, DType::kF32, {}, 0, 0};
  const std::string dtype_text = value["dtype"].get<std::string>();
  const std::optional<DType> dtype = parse_dtype(dtype_text);
  if (!dtype) return malformed(origin, where + " dtype", "one of F32, BF16, F16, F8_E4M3, I32, I64", in_quotes(dtype_text));
  entry.dtype = *dtype;
  if (!value.contains("shape") || !value["shape"].is_array())
    return malformed(origin, where + " shape", "an array of sizes", value.contains("shape") ? value["shape"].dump() : "nothing");
  if (value["shape"].size() > kMaxTensorRank)
    return malformed(origin, where + " shape", "at most " + std::to_string(kMaxTensorRank) + " dimensions", value["shape"].dump());
  for (const json& extent : value["shape"]) {
    if (!extent.is_number_unsigned()) return malformed(origin, where + " shape", "non-negative integers", value["shape"].dump());
    entry.shape.push_back(extent.get<int64_t>());
  }
  const json* offsets = value.contains("data_offsets") ? &value["data_offsets"] : nullptr;
  if (!offsets || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    return malformed(origin, where + " data_offsets", "[begin, end] as non-negative integers", offsets ? offsets->dump() : "nothing");
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  if (entry.begin > entry.end)
    return malformed(origin, where + " data_offsets", "begin <= end", offsets->dump());
  uint64_t bytes = dtype_size(entry.dtype);
  for (int64_t extent : entry.shape) bytes *= static_cast<uint64_t>(extent);
  if (entry.end - entry.begin != bytes)
    return malformed(origin, where + " data_offsets",
                     std::to_string(bytes) + " bytes for " + dtype_text + " " + value["shape"].dump(),
                     std::to_string(entry.end - entry.begin) + " bytes " + offsets->dump());
  return entry;
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  if (!stream) return Status::io_error(path + ": cannot open for reading");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
  if (stream.bad()) return Status::io_error(path + ": read failed");
  return parse(bytes, path);
}

Result<SafetensorsFile> SafetensorsFile::parse(const std::vector<uint8_t>& bytes, const std::string& origin) {
  if (bytes.size() < 8)
    return malformed(origin, "header length", "8 bytes at the start of the file",
                     "a file of " + std::to_string(bytes.size()) + " bytes");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[i];
  if (header_bytes > kMaxHeaderBytes || header_bytes > bytes.size() - 8)
    return malformed(origin, "header length",
                     "at most " + std::to_string(std::min<uint64_t>(kMaxHeaderBytes, bytes.size() - 8)) +
                         " bytes (the rest of the file)",
                     std::to_string(header_bytes));
  const json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_bytes),
                                  nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return malformed(origin, "header", "valid JSON", "text that does not parse");
  if (!header.is_object()) return malformed(origin, "header", "a JSON object", header.type_name());

  SafetensorsFile file;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return malformed(origin, "__metadata__", "an object of strings", value.type_name());
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string())
          return malformed(origin, "__metadata__ '" + key + "'", "a string", text.dump());
        file.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    Result<Entry> entry = parse_entry(origin, name, value);
    if (!entry.ok()) return entry.status();
    entries.push_back(std::move(entry).value());
  }

  const uint64_t data_bytes = bytes.size() - 8 - header_bytes;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  uint64_t previous_end = 0;
  std::string previous_name;
  for (const Entry& entry : entries) {
    if (entry.end > data_bytes)
      return malformed(origin, "tensor '" + entry.name + "' data_offsets",
                       "an end within the " + std::to_string(data_bytes) + " data bytes (file truncated?)",
                       "end " + std::to_string(entry.end));
    if (entry.begin < previous_end)
      return malformed(origin, "tensor '" + entry.name + "' data_offsets",
                       "no overlap with tensor '" + previous_name + "' (ends at " + std::to_string(previous_end) + ")",
                       "begin " + std::to_string(entry.begin));
    previous_end = entry.end;
    previous_name = entry.name;
  }

  file.data_ = std::make_shared<Buffer>(DType::kFP8E4M3, std::initializer_list<int64_t>{static_cast<int64_t>(data_bytes)});
  std::memcpy(file.data_->view().data, bytes.data() + 8 + header_bytes, data_bytes);
  for (const Entry& entry : entries) {
    file.tensors_[entry.name] =
        Tensor::contiguous(file.data_->data_as<uint8_t>() + entry.begin, entry.dtype, entry.shape);
  }
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : tensors_) names.push_back(name);
  return names;
}

std::optional<Tensor> SafetensorsFile::tensor(const std::string& name) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) return std::nullopt;
  return found->second;
}

Result<std::vector<uint8_t>> serialize_safetensors(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                   const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (tensor.device != Device::kCpu || !tensor.is_contiguous())
      return bad_argument("tensor '" + name + "'", "a contiguous host tensor", tensor.describe());
    if (name == "__metadata__" || header.contains(name))
      return bad_argument("tensor '" + name + "'", "a unique name", "a name already used");
    header[name] = {{"dtype", safetensors_dtype_name(tensor.dtype)},
                    {"shape", std::vector<int64_t>(tensor.shape.begin(), tensor.shape.begin() + tensor.rank)},
                    {"data_offsets", {offset, offset + tensor.nbytes()}}};
    offset += tensor.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  std::vector<uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  bytes.insert(bytes.end(), text.begin(), text.end());
  for (const auto& [name, tensor] : tensors) {
    const auto* data = static_cast<const uint8_t*>(tensor.data);
    bytes.insert(bytes.end(), data, data + tensor.nbytes());
  }
  return bytes;
}

Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  Result<std::vector<uint8_t>> bytes = serialize_safetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  std::ofstream stream(path, std::ios::binary);
  stream.write(reinterpret_cast<const char*>(bytes->data()), static_cast<std::streamsize>(bytes->size()));
  if (!stream) return Status::io_error(path + ": write failed");
  return {};
}

}  // namespace epmoe
