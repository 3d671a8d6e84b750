// PLACEHOLDER: replaced by the real trace reader/writer.
#include "monitor/trace.h"
namespace keel {
std::vector<double> Trace::ExpertCounts(int, int) const { return {}; }
Status Trace::Validate() const { return Status::Ok(); }
Result<TraceFormat> ParseTraceFormat(std::string_view) { return TraceFormat::kAuto; }
std::string_view TraceFormatName(TraceFormat) { return "auto"; }
Result<Trace> ReadTrace(const std::string&, TraceFormat) { return Unimplemented("trace"); }
Result<Trace> ReadKeelTrace(const std::string&) { return Unimplemented("trace"); }
Status WriteKeelTrace(const Trace&, const std::string&) { return Unimplemented("trace"); }
Result<Trace> GenerateSyntheticTrace(const SyntheticTraceOptions&) { return Unimplemented("trace"); }
}  // namespace keel
