#include "placement/lp_balance.h"

#include <glpk.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

namespace keel {
namespace {

struct ProblemDeleter {
  void operator()(glp_prob* problem) const { glp_delete_prob(problem); }
};

// One end of a replicated expert's edges: its copies on one rank.
struct Edge {
  int expert = 0;
  int rank = 0;
  int copies = 0;  // slots of the expert on the rank
};

}  // namespace

Result<LpBalance> SolveLpBalance(const Placement& placement, std::span<const double> expert_load) {
  const int num_experts = placement.num_experts();
  const int num_ranks = placement.num_ranks();
  if (static_cast<int>(expert_load.size()) != num_experts) {
    return InvalidArgument("expert_load has " + std::to_string(expert_load.size()) +
                           " entries, expected num_experts " + std::to_string(num_experts));
  }
  for (int e = 0; e < num_experts; ++e) {
    if (!std::isfinite(expert_load[e]) || expert_load[e] < 0) {
      return InvalidArgument("expert_load[" + std::to_string(e) + "] = " +
                             std::to_string(expert_load[e]) + " is not a finite count >= 0");
    }
  }

  // Experts held by one rank only are fixed load; every other expert gets an edge end per rank.
  std::vector<double> fixed(num_ranks, 0.0);
  std::vector<Edge> edges;
  std::vector<int> replicated;  // experts with edges, in id order
  for (int e = 0; e < num_experts; ++e) {
    const auto ranks = placement.copy_ranks(e);  // ascending with the slots
    const size_t first_edge = edges.size();
    for (int rank : ranks) {
      if (edges.size() > first_edge && edges.back().rank == rank) {
        ++edges.back().copies;
      } else {
        edges.push_back({e, rank, 1});
      }
    }
    if (edges.size() - first_edge == 1) {
      fixed[edges.back().rank] += expert_load[e];
      edges.pop_back();
    } else {
      replicated.push_back(e);
    }
  }

  LpBalance result;
  result.slot_tokens.assign(placement.num_slots(), 0.0);
  std::vector<double> edge_tokens(edges.size(), 0.0);
  if (edges.empty()) {
    result.max_rank_tokens = *std::max_element(fixed.begin(), fixed.end());
  } else {
    std::unique_ptr<glp_prob, ProblemDeleter> lp(glp_create_prob());
    glp_set_obj_dir(lp.get(), GLP_MIN);
    const int num_edges = static_cast<int>(edges.size());
    const int t_column = num_edges + 1;
    glp_add_cols(lp.get(), t_column);
    for (int column = 1; column <= num_edges; ++column) {
      glp_set_col_bnds(lp.get(), column, GLP_LO, 0.0, 0.0);
    }
    glp_set_col_bnds(lp.get(), t_column, GLP_LO, 0.0, 0.0);
    glp_set_obj_coef(lp.get(), t_column, 1.0);

    const int num_replicated = static_cast<int>(replicated.size());
    glp_add_rows(lp.get(), num_replicated + num_ranks);
    // GLPK's sparse matrix is 1-based: entry k is (row[k], column[k], value[k]).
    std::vector<int> row(1, 0);
    std::vector<int> column(1, 0);
    std::vector<double> value(1, 0.0);
    int expert_row = 0;
    for (int i = 0; i < num_edges; ++i) {
      if (i == 0 || edges[i].expert != edges[i - 1].expert) {
        ++expert_row;
        const double load = expert_load[edges[i].expert];
        glp_set_row_bnds(lp.get(), expert_row, GLP_FX, load, load);
      }
      row.push_back(expert_row);  // the expert's tokens, all on its edges
      column.push_back(i + 1);
      value.push_back(1.0);
      row.push_back(num_replicated + edges[i].rank + 1);  // the rank's load
      column.push_back(i + 1);
      value.push_back(1.0);
    }
    for (int r = 0; r < num_ranks; ++r) {
      glp_set_row_bnds(lp.get(), num_replicated + r + 1, GLP_UP, 0.0, -fixed[r]);
      row.push_back(num_replicated + r + 1);
      column.push_back(t_column);
      value.push_back(-1.0);
    }
    glp_load_matrix(lp.get(), static_cast<int>(row.size()) - 1, row.data(), column.data(),
                    value.data());

    glp_smcp parameters;
    glp_init_smcp(&parameters);
    parameters.msg_lev = GLP_MSG_OFF;
    const int failure = glp_simplex(lp.get(), &parameters);
    if (failure != 0 || glp_get_status(lp.get()) != GLP_OPT) {
      return Internal("GLPK's simplex found no optimum for the lplb program (glp_simplex " +
                      std::to_string(failure) + ", status " +
                      std::to_string(glp_get_status(lp.get())) + ")");
    }
    for (int i = 0; i < num_edges; ++i) {
      edge_tokens[i] = std::max(0.0, glp_get_col_prim(lp.get(), i + 1));
    }
    result.max_rank_tokens = glp_get_obj_val(lp.get());
  }

  // A fixed expert's tokens are shared by its slots, an edge's by the expert's slots on its rank.
  std::vector<char> is_replicated(num_experts, 0);
  for (int e : replicated) is_replicated[e] = 1;
  for (int e = 0; e < num_experts; ++e) {
    if (is_replicated[e]) continue;
    const auto slots = placement.copies(e);
    for (int slot : slots) result.slot_tokens[slot] = expert_load[e] / slots.size();
  }
  for (size_t i = 0; i < edges.size(); ++i) {
    const Edge& edge = edges[i];
    const auto slots = placement.copies(edge.expert);
    const auto ranks = placement.copy_ranks(edge.expert);
    for (size_t k = 0; k < slots.size(); ++k) {
      if (ranks[k] == edge.rank) result.slot_tokens[slots[k]] = edge_tokens[i] / edge.copies;
    }
  }
  return result;
}

}  // namespace keel
