// The safetensors reader and writer: round trips, and every kind of broken file rejected
// with a message that says what is wrong (truncated, malformed header, bad offsets).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "epmoe/safetensors.h"

namespace epmoe {
namespace {

std::vector<uint8_t> with_header(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> bytes(8 + header.size() + data_bytes, 0x5a);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  std::copy(header.begin(), header.end(), bytes.begin() + 8);
  return bytes;
}

std::string error_of(const std::vector<uint8_t>& bytes) {
  Result<SafetensorsFile> file = SafetensorsFile::parse(bytes, "case.safetensors");
  EXPECT_FALSE(file.ok());
  return file.status().message();
}

TEST(Safetensors, RoundTripsTensorsOfEveryDtypeAndMetadata) {
  std::mt19937 rng(std::random_device{}());
  std::vector<float> f32(6);
  for (float& v : f32) v = std::uniform_real_distribution<float>(-5, 5)(rng);
  std::vector<uint16_t> bf16(5);
  for (auto& v : bf16) v = static_cast<uint16_t>(rng());
  std::vector<uint8_t> fp8(7);
  for (auto& v : fp8) v = static_cast<uint8_t>(rng());
  std::vector<int32_t> i32 = {-1, 3, 7};
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"a", Tensor::contiguous(f32.data(), DType::kF32, {2, 3})},
      {"b", Tensor::contiguous(bf16.data(), DType::kBF16, {5})},
      {"c", Tensor::contiguous(fp8.data(), DType::kFP8E4M3, {7, 1})},
      {"d", Tensor::contiguous(i32.data(), DType::kI32, {3})}};
  Result<std::vector<uint8_t>> bytes = serialize_safetensors(tensors, {{"k", "v w"}});
  ASSERT_TRUE(bytes.ok());
  Result<SafetensorsFile> file = SafetensorsFile::parse(bytes.value(), "memory");
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(file->metadata().at("k"), "v w");
  EXPECT_EQ(file->names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  for (const auto& [name, original] : tensors) {
    const std::optional<Tensor> read = file->tensor(name);
    ASSERT_TRUE(read.has_value());
    EXPECT_EQ(read->dtype, original.dtype);
    EXPECT_EQ(read->shape_string(), original.shape_string());
    EXPECT_EQ(std::memcmp(read->data, original.data, original.nbytes()), 0) << name;
  }
  EXPECT_FALSE(file->tensor("e").has_value());
}

TEST(Safetensors, EveryTruncationIsRejected) {
  std::vector<float> values = {1, 2, 3, 4};
  const auto bytes = serialize_safetensors({{"w", Tensor::contiguous(values.data(), DType::kF32, {4})}}, {}).value();
  for (size_t length = 0; length < bytes.size(); ++length) {
    const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<int64_t>(length));
    EXPECT_FALSE(SafetensorsFile::parse(cut, "cut").ok()) << "accepted a file cut to " << length << " bytes";
  }
  EXPECT_EQ(error_of(std::vector<uint8_t>(bytes.begin(), bytes.end() - 1)),
            "case.safetensors: tensor 'w' data_offsets: expected an end within the 15 data bytes (file truncated?), got end 16");
}

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  EXPECT_EQ(error_of({1, 2, 3}), "case.safetensors: header length: expected 8 bytes at the start of the file, got a file of 3 bytes");
  auto huge = with_header("{}", 0);
  huge[5] = 1;
  EXPECT_EQ(error_of(huge), "case.safetensors: header length: expected at most 2 bytes (the rest of the file), got 1099511627778");
  EXPECT_EQ(error_of(with_header("{\"w\": ", 0)), "case.safetensors: header: expected valid JSON, got text that does not parse");
  EXPECT_EQ(error_of(with_header("[1]", 0)), "case.safetensors: header: expected a JSON object, got array");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8)),
            "case.safetensors: tensor 'w' dtype: expected one of F32, BF16, F16, F8_E4M3, I32, I64, got 'F64'");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4)),
            "case.safetensors: tensor 'w' shape: expected non-negative integers, got [-1]");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 8)),
            "case.safetensors: tensor 'w' data_offsets: expected 8 bytes for F32 [2], got 4 bytes [0,4]");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 8)),
            "case.safetensors: tensor 'w' data_offsets: expected begin <= end, got [4,0]");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F32", "shape": [1]}})", 4)),
            "case.safetensors: tensor 'w' data_offsets: expected [begin, end] as non-negative integers, got nothing");
  EXPECT_EQ(error_of(with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                     "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8)),
            "case.safetensors: tensor 'b' data_offsets: expected no overlap with tensor 'a' (ends at 8), got begin 4");
  EXPECT_EQ(error_of(with_header(R"({"__metadata__": {"k": 1}})", 0)),
            "case.safetensors: __metadata__ 'k': expected a string, got 1");
  EXPECT_EQ(error_of(with_header(R"({"w": {"dtype": "F32", "shape": [1, 1, 1, 1, 1], "data_offsets": [0, 4]}})", 4)),
            "case.safetensors: tensor 'w' shape: expected at most 4 dimensions, got [1,1,1,1,1]");
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  std::vector<float> values(32, 1.5f);
  const auto bytes = serialize_safetensors({{"w", Tensor::contiguous(values.data(), DType::kF32, {4, 8})}},
                                           {{"epmoe.spec", "{}"}})
                         .value();
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> corrupted = bytes;
    for (int flips = 0; flips < 3; ++flips) corrupted[rng() % 120] = static_cast<uint8_t>(rng());
    Result<SafetensorsFile> file = SafetensorsFile::parse(corrupted, "fuzz");
    if (file.ok()) {
      for (const std::string& name : file->names()) EXPECT_LE(file->tensor(name)->nbytes(), corrupted.size());
    } else {
      EXPECT_FALSE(file.status().message().empty());
    }
  }
}

TEST(Safetensors, MissingFileIsAnIoError) {
  Result<SafetensorsFile> file = SafetensorsFile::open("/nonexistent/file.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kIoError);
  EXPECT_EQ(file.status().message(), "/nonexistent/file.safetensors: cannot open for reading");
}

}  // namespace
}  // namespace epmoe
