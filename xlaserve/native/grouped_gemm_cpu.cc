// The experts' grouped matmul on the CPU, over weights packed as the dense GEMM's (gemm_cpu.cc), as
// an XLA FFI custom call (grouped_gemm_cpu.py): x [M, K] has its rows sorted by group, group g's
// `group_sizes[g]` rows are multiplied by matrix g of W [(L,) G, ceil(N/P), K, P], and y [M, N]
// (float32) is zero past the groups' total (model/grouped_matmul.py's contract).
//
// The work items are (group, run of panels): each reads its run of its expert's panels, one
// contiguous stream, once for all the group's rows, through the dense GEMM's `PanelRange`. A
// group with no rows makes no item, so its weights are never read. A decode step (1-8 tokens,
// each routed to 8 experts) has groups of about one row: splitting a group's panels into runs
// keeps both cores streaming weights when few groups are non-empty, where one item per group
// would leave a core idle. XLA's CPU dot of those few rows, in the tiled loop this replaces
// (grouped_matmul_tiled), ran at about a third of the memory bandwidth.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_tiles.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve::gemm;

// Work items per thread to aim for: more items balance the threads better when groups differ in
// size; each costs one claim from a shared counter.
constexpr int64_t kItemsPerThread = 8;

struct Item {
  int64_t group, first, last;  // panels [first, last) of the group's matrix
};

// The items of a step: each non-empty group's panels in runs, about as many runs as its share of
// the rows earns of kItemsPerThread x threads (at least one), in group order, so that one thread
// taking consecutive items streams one expert's weights.
std::vector<Item> PlanItems(const std::vector<int64_t>& sizes, int64_t total, int64_t panels,
                            int64_t threads) {
  std::vector<Item> items;
  const int64_t target = kItemsPerThread * std::max<int64_t>(threads, 1);
  for (int64_t g = 0; g < static_cast<int64_t>(sizes.size()); ++g) {
    if (sizes[g] == 0) continue;
    const int64_t runs = std::clamp<int64_t>((target * sizes[g] + total - 1) / total, 1, panels);
    const int64_t run = (panels + runs - 1) / runs;
    for (int64_t p = 0; p < panels; p += run) items.push_back({g, p, std::min(panels, p + run)});
  }
  return items;
}

template <typename Mode>
void GroupedGemm(ffi::ThreadPool& pool, const typename Mode::X* x, const typename Mode::W* w,
                 int64_t matrix, const std::vector<int64_t>& starts, const std::vector<Item>& items,
                 float* y, int64_t units, int64_t n) {
  xlaserve::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const int64_t start = starts[item.group], rows = starts[item.group + 1] - start;
    PanelRange<Mode>(x + start * units, w + item.group * matrix, y + start * n, rows, units, n,
                     item.first, item.last);
  });
}

ffi::Error GroupedGemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t layer,
                           bool bf16_pairs, bool invariant) {
  const std::string what = "grouped packed GEMM (CPU)";
  auto yd = y->dimensions();
  if (yd.size() != 2) return ffi::Error::InvalidArgument(what + ": y [M, N]");
  const int64_t n = yd[1];
  Operands ops;
  if (auto error = CheckOperands(what, x, w, yd[0], n, layer, bf16_pairs, ops, /*grouped=*/true);
      error.failure())
    return error;
  auto gd = group_sizes.dimensions();
  if (gd.size() != 1 || gd[0] != ops.groups)
    return ffi::Error::InvalidArgument(what + ": group_sizes [G], one per matrix of W");
  std::vector<int64_t> sizes(ops.groups), starts(ops.groups + 1, 0);
  for (int64_t g = 0; g < ops.groups; ++g) {
    sizes[g] = group_sizes.typed_data()[g];
    if (sizes[g] < 0) return ffi::Error::InvalidArgument(what + ": a negative group size");
    starts[g + 1] = starts[g] + sizes[g];
  }
  const int64_t total = starts[ops.groups];
  if (total > ops.m)
    return ffi::Error::InvalidArgument(what + ": the groups hold more rows than x");
  float* out = y->typed_data();
  std::memset(out + total * n, 0, (ops.m - total) * n * sizeof(float));
  if (total == 0 || n == 0) return ffi::Error::Success();
  if (ops.k == 0) {
    std::memset(out, 0, total * n * sizeof(float));
    return ffi::Error::Success();
  }
  const std::vector<Item> items = PlanItems(sizes, total, (n + kPanel - 1) / kPanel,
                                            pool.num_threads());
  WithMode(x, w, ops, bf16_pairs, invariant, [&](auto mode, const auto* xs, const auto* ws, int64_t units) {
    GroupedGemm<decltype(mode)>(pool, xs, ws, ops.matrix, starts, items, out, units, n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGroupedPackedGemm, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]: f32 (bf16: pairs)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Arg<ffi::AnyBuffer>()         // W [(L,) G, panels, K, kPanel]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("layer")
                                  .Attr<bool>("bf16_pairs")
                                  .Attr<bool>("invariant"));
