// The SBHD kernels' division by the batch size (csa_params.h's RowDivisor, which both compilers
// see): every quotient the kernels can ask for against the integer division.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "csa_params.h"

namespace csa::test {
namespace {

constexpr std::int32_t kMaxRow = 0x7fffffff;

void expect_quotients(std::int32_t divisor, const std::vector<std::int32_t>& rows) {
  const csa_kernel::RowDivisor d = csa_kernel::row_divisor(divisor);
  for (const std::int32_t row : rows) {
    ASSERT_EQ(csa_kernel::divide_row(row, d), row / divisor)
        << "row " << row << " / " << divisor << " (multiplier " << d.multiplier << ", shift "
        << d.shift << ")";
  }
}

// The rows where a quotient changes (q * d - 1, q * d) and the ends of the range.
std::vector<std::int32_t> edge_rows(std::int32_t divisor) {
  std::vector<std::int32_t> rows = {0, 1, kMaxRow, kMaxRow - 1};
  for (std::int64_t q : {std::int64_t{1}, std::int64_t{2}, std::int64_t{3},
                         std::int64_t{kMaxRow} / divisor, std::int64_t{kMaxRow} / divisor - 1}) {
    for (std::int64_t r : {q * divisor - 1, q * divisor, q * divisor + 1}) {
      if (r >= 0 && r <= kMaxRow) rows.push_back(static_cast<std::int32_t>(r));
    }
  }
  return rows;
}

TEST(RowDivisor, EverySmallDivisorDividesEveryRowOfItsFirstBlocksAndTheRangeEnds) {
  for (std::int32_t divisor = 1; divisor <= 1024; ++divisor) {
    std::vector<std::int32_t> rows = edge_rows(divisor);
    for (std::int32_t row = 0; row < 4096; ++row) rows.push_back(row);
    expect_quotients(divisor, rows);
  }
}

TEST(RowDivisor, PowersOfTwoTheirNeighboursAndTheLargestDivisorsDivideSampledRows) {
  const std::uint32_t seed = 20261205;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::int32_t> any_row(0, kMaxRow);
  std::vector<std::int32_t> divisors = {kMaxRow, kMaxRow - 1, 46341, 65535, 65537};
  for (int bit = 1; bit < 31; ++bit) {
    for (int delta : {-1, 0, 1}) divisors.push_back((std::int32_t{1} << bit) + delta);
  }
  for (const std::int32_t divisor : divisors) {
    std::vector<std::int32_t> rows = edge_rows(divisor);
    for (int i = 0; i < 20000; ++i) rows.push_back(any_row(gen));
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    expect_quotients(divisor, rows);
  }
}

TEST(RowDivisor, RandomDivisorsDivideRandomRows) {
  const std::uint32_t seed = 7;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::int32_t> any(1, kMaxRow);
  for (int i = 0; i < 2000; ++i) {
    const std::int32_t divisor = any(gen) >> (i % 31);
    std::vector<std::int32_t> rows = edge_rows(std::max(divisor, 1));
    for (int j = 0; j < 200; ++j) rows.push_back(any(gen) - 1);
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    expect_quotients(std::max(divisor, 1), rows);
  }
}

}  // namespace
}  // namespace csa::test
