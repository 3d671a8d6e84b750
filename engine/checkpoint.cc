// Engine checkpoints: the engine's state (placement in force, homes, epoch) as JSON, and every
// expert's weights and optimizer state by logical id, one file each, so that a checkpoint loads
// into any placement and any number of ranks.
#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/file.h"
#include "common/json.h"
#include "common/log.h"
#include "engine/engine_impl.h"
#include "engine/expert_file.h"

namespace keel {
namespace {

// Where an expert's file is; a shard of a sharded expert has a file of its own.
std::string ExpertPath(const std::string& dir, int layer, int expert, int shard, int shards) {
  const std::string name =
      dir + "/layer-" + std::to_string(layer) + "/expert-" + std::to_string(expert);
  if (shards == 1) return name + ".bin";
  return name + ".shard-" + std::to_string(shard) + "-of-" + std::to_string(shards) + ".bin";
}

// The element size of the weights as the shard layout gives it; 0 when it gives none or several.
uint32_t WeightElementBytes(const ShardLayout& layout) {
  if (layout.weights.empty()) return 0;
  const size_t first = layout.weights.front().element_bytes;
  for (const ShardedTensor& tensor : layout.weights) {
    if (tensor.element_bytes != first) return 0;
  }
  return static_cast<uint32_t>(first);
}

Result<std::vector<int32_t>> IntArray(const nlohmann::json& value, const std::string& where) {
  if (!value.is_array()) return InvalidArgument(where + " must be an array of integers");
  std::vector<int32_t> out;
  for (size_t i = 0; i < value.size(); ++i) {
    KEEL_ASSIGN_OR_RETURN(
        const int64_t v,
        JsonInteger(value[i], where + "[" + std::to_string(i) + "]", -1, INT32_MAX));
    out.push_back(static_cast<int32_t>(v));
  }
  return out;
}

}  // namespace

std::string EngineStateToJson(const EngineState& state) {
  nlohmann::json out;
  out["keel_engine_state"] = 1;
  out["epoch"] = state.epoch;
  out["phy2log"] = state.phy2log;
  out["home"] = state.home;
  if (!state.shards.empty()) out["shards"] = state.shards;
  return out.dump() + "\n";
}

Result<EngineState> EngineStateFromJson(std::string_view text) {
  Result<nlohmann::json> parsed = ParseJson(text, "not a JSON object");
  if (!parsed.ok()) return parsed.status().WithContext("engine state");
  const nlohmann::json& in = *parsed;
  if (!in.is_object()) return InvalidArgument("engine state: not a JSON object");
  if (!in.contains("keel_engine_state")) {
    return InvalidArgument("engine state: keel_engine_state must be 1");
  }
  KEEL_RETURN_IF_ERROR(
      JsonInteger(in["keel_engine_state"], "engine state: keel_engine_state", 1, 1).status());
  EngineState state;
  if (!in.contains("epoch")) return InvalidArgument("engine state: epoch is missing");
  KEEL_ASSIGN_OR_RETURN(state.epoch, JsonInteger(in["epoch"], "engine state: epoch", 0));
  for (const char* key : {"phy2log", "home"}) {
    if (!in.contains(key) || !in[key].is_array()) {
      return InvalidArgument(std::string("engine state: ") + key + " must be an array per layer");
    }
  }
  if (in["phy2log"].size() != in["home"].size()) {
    return InvalidArgument("engine state: phy2log has " + std::to_string(in["phy2log"].size()) +
                           " layers, home " + std::to_string(in["home"].size()));
  }
  for (size_t l = 0; l < in["phy2log"].size(); ++l) {
    const std::string layer = "[" + std::to_string(l) + "]";
    KEEL_ASSIGN_OR_RETURN(std::vector<int32_t> phy2log,
                          IntArray(in["phy2log"][l], "engine state: phy2log" + layer));
    KEEL_ASSIGN_OR_RETURN(std::vector<int32_t> home,
                          IntArray(in["home"][l], "engine state: home" + layer));
    state.phy2log.push_back(std::move(phy2log));
    state.home.push_back(std::move(home));
  }
  if (in.contains("shards")) {
    if (!in["shards"].is_array() || in["shards"].size() != in["phy2log"].size()) {
      return InvalidArgument("engine state: shards must be an array per layer, as phy2log is");
    }
    for (size_t l = 0; l < in["shards"].size(); ++l) {
      KEEL_ASSIGN_OR_RETURN(
          std::vector<int32_t> shards,
          IntArray(in["shards"][l], "engine state: shards[" + std::to_string(l) + "]"));
      state.shards.push_back(std::move(shards));
    }
  }
  return state;
}

// RestoreState and LoadExperts change what the slots hold: only before training starts.
Status Engine::Impl::BeforeFirstRoute(const char* what) const {
  if (stats_.steps > 0 || std::any_of(step_.begin(), step_.end(),
                                      [](const LayerStep& layer) { return layer.routes > 0; })) {
    return FailedPrecondition(std::string(what) + " must come before the first Route");
  }
  return Status::Ok();
}

EngineState Engine::Impl::SaveState() const {
  EngineState state;
  state.epoch = stats_.epoch;
  bool sharded = false;
  for (size_t l = 0; l < placements_.size(); ++l) {
    const Placement& p = placements_[l];
    state.phy2log.emplace_back(p.phy2log().begin(), p.phy2log().end());
    state.home.emplace_back(p.home().begin(), p.home().end());
    std::vector<int32_t> shards(options_.num_experts);
    for (int e = 0; e < options_.num_experts; ++e) shards[e] = shards_[l].shards(e);
    state.shards.push_back(std::move(shards));
    sharded |= shards_[l].sharded();
  }
  if (!sharded) state.shards.clear();
  return state;
}

Status Engine::Impl::RestoreState(const EngineState& state) {
  std::vector<Placement> restored;
  std::vector<ShardMap> units;
  KEEL_RETURN_IF_ERROR(
      AgreeOnCall(CollectiveCall::kRestoreState, -1, CheckState(state, restored, units)));
  // Every rank must restore the same state, or their placements would diverge.
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> states,
                        communicator_.AllGather(EngineStateToJson(state)));
  for (int r = 0; r < num_ranks_; ++r) {
    if (states[r] != states[0]) {
      return InvalidArgument("rank " + std::to_string(r) +
                             " restores another engine state than rank 0");
    }
  }
  for (int l = 0; l < options_.num_layers; ++l) {
    KEEL_RETURN_IF_ERROR(SetUnits(l, std::move(units[l])));
  }
  placements_ = std::move(restored);
  stats_.epoch = state.epoch;
  if (metrics_ != nullptr) metrics_->SetEpoch(stats_.epoch);
  return Status::Ok();
}

Status Engine::Impl::CheckState(const EngineState& state, std::vector<Placement>& restored,
                                std::vector<ShardMap>& units) const {
  KEEL_RETURN_IF_ERROR(BeforeFirstRoute("RestoreState"));
  const int layers = options_.num_layers;
  if (static_cast<int>(state.phy2log.size()) != layers ||
      static_cast<int>(state.home.size()) != layers) {
    return InvalidArgument("engine state has " + std::to_string(state.phy2log.size()) +
                           " layers of phy2log and " + std::to_string(state.home.size()) +
                           " of home; this engine has " + std::to_string(layers));
  }
  if (!state.shards.empty() && static_cast<int>(state.shards.size()) != layers) {
    return InvalidArgument("engine state has " + std::to_string(state.shards.size()) +
                           " layers of shards; this engine has " + std::to_string(layers));
  }
  const int per_node = context_->topology.gpus_per_node();
  for (int l = 0; l < layers; ++l) {
    const std::string where = "engine state layer " + std::to_string(l) + ": ";
    std::vector<int> shards(options_.num_experts, 1);
    if (!state.shards.empty()) {
      if (state.shards[l].size() != shards.size()) {
        return InvalidArgument(where + "shards has " + std::to_string(state.shards[l].size()) +
                               " experts; this engine has " + std::to_string(shards.size()));
      }
      for (size_t e = 0; e < shards.size(); ++e) {
        shards[e] = state.shards[l][e];
        if (shards[e] < 1 || shards[e] > per_node) {
          return InvalidArgument(
              where + "shards[" + std::to_string(e) + "] = " + std::to_string(shards[e]) +
              " is not in [1, topology.gpus_per_node = " + std::to_string(per_node) + "]");
        }
        if (!ShardsFit(shards[e])) {
          return InvalidArgument(where + "shards[" + std::to_string(e) +
                                 "] = " + std::to_string(shards[e]) +
                                 " does not divide every tensor of shard_layout");
        }
      }
    }
    units.push_back(std::move(ShardMap::Create(std::move(shards))).value());
    if (static_cast<int>(state.phy2log[l].size()) != num_slots()) {
      return InvalidArgument(where + "phy2log has " + std::to_string(state.phy2log[l].size()) +
                             " slots; this engine has " + std::to_string(num_slots()) + " (" +
                             std::to_string(num_ranks_) + " ranks x " +
                             std::to_string(slots_per_rank_) +
                             " slots): restore a state into a job of the same shape, or load "
                             "only the experts (LoadExperts)");
    }
    Result<Placement> p =
        Placement::Create(units[l].num_units(), num_ranks_,
                          std::vector<int>(state.phy2log[l].begin(), state.phy2log[l].end()),
                          std::vector<int>(state.home[l].begin(), state.home[l].end()));
    if (!p.ok()) return InvalidArgument(where + p.status().message());
    restored.push_back(std::move(*p));
  }
  return Status::Ok();
}

Status Engine::Impl::SaveExperts(const std::string& dir) const {
  KEEL_RETURN_IF_ERROR(CheckOutputFolder("dir", dir).WithContext("SaveExperts"));
  const size_t weight_bytes = options_.shape.weight_bytes;
  const size_t optimizer_bytes = options_.shape.optimizer_bytes;
  std::vector<std::byte> contents(kExpertFileHeaderBytes + weight_bytes + optimizer_bytes);
  std::byte* data = contents.data() + kExpertFileHeaderBytes;
  ExpertFileFields fields;
  fields.weight_element_bytes = WeightElementBytes(options_.shard_layout);
  fields.weight_bytes = weight_bytes;
  fields.optimizer_bytes = optimizer_bytes;
  for (int l = 0; l < options_.num_layers; ++l) {
    std::error_code error;
    const std::string folder = dir + "/layer-" + std::to_string(l);
    std::filesystem::create_directories(folder, error);
    if (error) return IoError("cannot create " + folder + ": " + error.message());
    for (const HomeSlot& home : HomeSlots(l)) {
      if (!is_registered_[static_cast<size_t>(l) * local_slots() + home.local_slot]) {
        return FailedPrecondition("SaveExperts: layer " + std::to_string(l) + " slot " +
                                  std::to_string(home.local_slot) + " is not registered");
      }
      const SlotBuffers& b = Buffers(l, home.local_slot);
      KEEL_RETURN_IF_ERROR(
          memory_->Copy(data, static_cast<const std::byte*>(b.weights), weight_bytes));
      if (optimizer_bytes > 0) {
        KEEL_RETURN_IF_ERROR(memory_->Copy(
            data + weight_bytes, static_cast<const std::byte*>(b.optimizer), optimizer_bytes));
      }
      fields.layer = l;
      fields.expert = home.expert;
      fields.shard = home.shard;
      fields.shards = home.shards;
      WriteExpertFileHeader(fields, contents);
      KEEL_RETURN_IF_ERROR(WriteFileAtomically(
          ExpertPath(dir, l, home.expert, home.shard, home.shards),
          std::string_view(reinterpret_cast<const char*>(contents.data()), contents.size())));
    }
  }
  return Status::Ok();
}

// Every file is read and checked before the first slot changes, so a bad file (corrupt,
// truncated, another expert's, or missing) leaves every slot as it was. This rank's files are
// held in host memory meanwhile, each once however many of its slots hold that expert.
Status Engine::Impl::LoadExperts(const std::string& dir) {
  KEEL_RETURN_IF_ERROR(BeforeFirstRoute("LoadExperts"));
  if (dir.empty()) {
    return InvalidArgument("LoadExperts: dir is empty: name the folder SaveExperts wrote");
  }
  const size_t weight_bytes = options_.shape.weight_bytes;
  const size_t optimizer_bytes = options_.shape.optimizer_bytes;
  struct SlotFill {
    int layer = 0;
    int local_slot = 0;
    bool home = false;
    const std::byte* payload = nullptr;
  };
  struct CheckedFile {
    std::string contents;
    ExpertFilePayload payload;
  };
  std::map<std::string, CheckedFile> files;  // by path
  std::vector<SlotFill> fills;
  std::vector<std::string> unverified;  // version-1 files
  ExpertFileFields expected;
  expected.weight_element_bytes = WeightElementBytes(options_.shard_layout);
  expected.weight_bytes = weight_bytes;
  expected.optimizer_bytes = optimizer_bytes;
  // A file is read only as far as a file of this engine's shape goes: a larger one (a device, or
  // a file that is not an expert's) is refused before it is read.
  const std::string file_size_text = "the size of an expert file of this engine (" +
                                     std::to_string(kExpertFileHeaderBytes) + " of header, " +
                                     std::to_string(weight_bytes) + " of weights, " +
                                     std::to_string(optimizer_bytes) + " of optimizer state)";
  const ReadOptions read_options{
      .max_bytes = kExpertFileHeaderBytes + weight_bytes + optimizer_bytes,
      .subject = file_size_text};
  for (int l = 0; l < options_.num_layers; ++l) {
    const Placement& p = placements_[l];
    const ShardMap& units = shards_[l];
    for (int i = 0; i < slots_per_rank_; ++i) {
      const int slot = rank_ * slots_per_rank_ + i;
      const int unit = p.expert_at(slot);
      if (unit < 0) continue;
      if (!is_registered_[static_cast<size_t>(l) * local_slots() + i]) {
        return FailedPrecondition("LoadExperts: layer " + std::to_string(l) + " slot " +
                                  std::to_string(i) + " is not registered");
      }
      expected.layer = l;
      expected.expert = units.expert_of(unit);
      expected.shard = units.shard_of(unit);
      expected.shards = units.shards(expected.expert);
      const std::string path = ExpertPath(dir, l, expected.expert, expected.shard, expected.shards);
      // A replica and its home on this rank share the file: read and checked once.
      auto [file, added] = files.try_emplace(path);
      CheckedFile& checked = file->second;
      if (added) {
        KEEL_ASSIGN_OR_RETURN(checked.contents, ReadFile(path, read_options));
        KEEL_ASSIGN_OR_RETURN(checked.payload, CheckExpertFile(path, checked.contents, expected));
        if (checked.payload.version == 1) unverified.push_back(path);
      }
      fills.push_back(
          {l, i, p.home_slot(unit) == slot,
           reinterpret_cast<const std::byte*>(checked.contents.data() + checked.payload.offset)});
    }
  }
  if (!unverified.empty()) {
    KEEL_LOG_WARN(
        "LoadExperts: %zu expert files of version 1 (KEELEXP1, first %s) carry no checksum and "
        "no expert id; they were loaded unverified (SaveExperts writes version 2)",
        unverified.size(), unverified.front().c_str());
  }
  for (const SlotFill& fill : fills) {
    const SlotBuffers& b = Buffers(fill.layer, fill.local_slot);
    KEEL_RETURN_IF_ERROR(
        memory_->Copy(static_cast<std::byte*>(b.weights), fill.payload, weight_bytes));
    if (optimizer_bytes > 0 && fill.home) {
      KEEL_RETURN_IF_ERROR(memory_->Copy(static_cast<std::byte*>(b.optimizer),
                                         fill.payload + weight_bytes, optimizer_bytes));
    }
  }
  return Status::Ok();
}

EngineState Engine::SaveState() const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
  return impl_->SaveState();
}
Status Engine::RestoreState(const EngineState& state) {
  Impl::ExclusiveCall call(*impl_, "RestoreState");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->RestoreState(state);
}
Status Engine::SaveExperts(const std::string& dir) const {
  Impl::ExclusiveCall call(*impl_, "SaveExperts");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->SaveExperts(dir);
}
Status Engine::LoadExperts(const std::string& dir) {
  Impl::ExclusiveCall call(*impl_, "LoadExperts");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->LoadExperts(dir);
}

}  // namespace keel
