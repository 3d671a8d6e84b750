// MigrateSequences: one exchange item per sequence on the sequence channel.
#include "migration/sequence_migration.h"

#include <string>
#include <vector>

#include "migration/exchange.h"

namespace keel {

Status MigrateSequences(Transport& transport, uint64_t batch, std::span<const SequenceMove> moves,
                        const MigrationConfig& config, MigrationObserver* observer,
                        MigrationReport* report) {
  KEEL_ASSIGN_OR_RETURN(ExchangeOptions options, ExchangeOptions::FromConfig(config));
  std::vector<ExchangeItem> items;
  items.reserve(moves.size());
  for (const SequenceMove& move : moves) {
    ExchangeItem item;
    item.src_rank = move.src_rank;
    item.dst_rank = move.dst_rank;
    item.label = "sequence " + std::to_string(move.sequence_id) + " rank " +
                 std::to_string(move.src_rank) + " -> rank " + std::to_string(move.dst_rank);
    item.num_regions = 1;
    item.region_bytes[0] = move.bytes;
    item.source[0] = move.source;
    item.destination[0] = move.destination;
    items.push_back(std::move(item));
  }
  ExchangeRun run;
  run.channel = ExchangeChannel::kSequences;
  run.epoch = batch;
  run.what = "sequence migration " + std::to_string(batch);
  return RunExchange(transport, items, options, run, observer, report);
}

}  // namespace keel
