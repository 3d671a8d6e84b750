// Seeded inputs for the collective tests (threads in communicator_test.cc, processes in
// communicator_mpi_main.cc): every rank derives what every other rank contributes in a round.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace keel::collective_data {

inline std::mt19937_64 Generator(int round, int a, int b = 0) {
  return std::mt19937_64(static_cast<uint64_t>(round) * 1000003 + a * 1009 + b);
}

// Rank `rank`'s doubles in `round`: magnitudes from 2^-30 to 2^30 with both signs, so the sum
// depends on the order it is folded in.
inline std::vector<double> DoubleValues(int round, int rank, size_t n) {
  std::mt19937_64 generator = Generator(round, rank, 1);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<double> values(n);
  for (double& value : values) value = std::ldexp(mantissa(generator), exponent(generator));
  return values;
}

inline std::vector<int64_t> IntValues(int round, int rank, size_t n) {
  std::mt19937_64 generator = Generator(round, rank, 2);
  std::uniform_int_distribution<int64_t> value(-1'000'000'000'000, 1'000'000'000'000);
  std::vector<int64_t> values(n);
  for (int64_t& v : values) v = value(generator);
  return values;
}

// The bytes rank `from` sends to rank `to` in `round`: a quarter of the slices empty, the rest of
// uneven size below `max_length`.
inline std::vector<std::byte> Slice(int round, int from, int to, size_t max_length) {
  std::mt19937_64 generator = Generator(round, from, 100 + to);
  const size_t length = generator() % 4 == 0 ? 0 : generator() % max_length;
  std::vector<std::byte> bytes(length);
  for (std::byte& b : bytes) b = static_cast<std::byte>(generator());
  return bytes;
}

// What `root` broadcasts in `round` (empty every fifth round).
inline std::string BroadcastPayload(int round, int root) {
  std::mt19937_64 generator = Generator(round, root, 3);
  const size_t length = round % 5 == 0 ? 0 : generator() % 100000;
  std::string bytes(length, '\0');
  for (char& c : bytes) c = static_cast<char>(generator());
  return bytes;
}

}  // namespace keel::collective_data
