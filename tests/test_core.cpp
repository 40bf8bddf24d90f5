// core: Status messages, Tensor views and Buffer ownership.
#include <gtest/gtest.h>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {
namespace {

TEST(Status, BadArgumentNamesArgumentExpectedAndGiven) {
  const Status status = bad_argument("w13", "shape [8, 192, 64]", "shape [8, 128, 64]");
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "w13: expected shape [8, 192, 64], got shape [8, 128, 64]");
  EXPECT_EQ(status.to_string(), "invalid argument: w13: expected shape [8, 192, 64], got shape [8, 128, 64]");
  EXPECT_TRUE(Status().ok());
}

TEST(Result, HoldsValueOrStatus) {
  Result<int> value = 7;
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(value.value(), 7);
  Result<int> error = Status::io_error("disk");
  ASSERT_FALSE(error.ok());
  EXPECT_EQ(error.status().message(), "disk");
}

TEST(Tensor, ContiguousViewHasRowMajorStrides) {
  float data[24];
  const Tensor t = Tensor::contiguous(data, DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.has_shape({2, 3, 4}));
  EXPECT_FALSE(t.has_shape({2, 12}));
  EXPECT_EQ(t.describe(), "f32 [2, 3, 4] on cpu");
  Tensor strided = t;
  strided.strides[2] = 2;
  EXPECT_FALSE(strided.is_contiguous());
}

TEST(Buffer, OwnsAlignedZeroedMemoryOfTheRightSize) {
  Buffer buffer(DType::kBF16, {5, 7});
  EXPECT_EQ(buffer.numel(), 35);
  EXPECT_EQ(buffer.view().dtype, DType::kBF16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.view().data) % 64, 0u);
  for (int i = 0; i < 35; ++i) EXPECT_EQ(buffer.data_as<uint16_t>()[i], 0);
}

}  // namespace
}  // namespace epmoe
