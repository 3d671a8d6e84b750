// Hand-written SVG for `keel replay --plot`: a line chart and a heatmap sharing one step axis.
#include "tools/svg_plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string_view>
#include <vector>

namespace keel::tools {
namespace {

constexpr double kWidth = 1000;
constexpr double kLeft = 72;    // plot area, shared by both panels
constexpr double kRight = 828;  // legend and color bar live to the right of this
constexpr int kMaxColumns = 600;
constexpr const char* kFont = "Helvetica, Arial, sans-serif";

struct Rgb {
  double r, g, b;
};

// Viridis, approximated by linear interpolation between nine of its colors: perceptually
// ordered and readable by color-blind viewers.
Rgb Viridis(double t) {
  static constexpr std::array<Rgb, 9> kStops = {{{68, 1, 84},
                                                 {71, 44, 122},
                                                 {59, 81, 139},
                                                 {44, 113, 142},
                                                 {33, 144, 141},
                                                 {39, 173, 129},
                                                 {92, 200, 99},
                                                 {170, 220, 50},
                                                 {253, 231, 37}}};
  t = std::clamp(t, 0.0, 1.0) * (kStops.size() - 1);
  const size_t i = std::min(static_cast<size_t>(t), kStops.size() - 2);
  const double f = t - static_cast<double>(i);
  return {kStops[i].r + (kStops[i + 1].r - kStops[i].r) * f,
          kStops[i].g + (kStops[i + 1].g - kStops[i].g) * f,
          kStops[i].b + (kStops[i + 1].b - kStops[i].b) * f};
}

std::string Hex(const Rgb& c) {
  char buffer[8];
  std::snprintf(buffer, sizeof(buffer), "#%02x%02x%02x", static_cast<int>(std::lround(c.r)),
                static_cast<int>(std::lround(c.g)), static_cast<int>(std::lround(c.b)));
  return buffer;
}

// One color per policy name, stable across reports so the same policy always looks the same.
std::string PolicyColor(std::string_view name, size_t index) {
  if (name == "static") return "#8c8c8c";
  if (name == "eplb") return "#4e79a7";
  if (name == "flexmoe") return "#f28e2b";
  if (name == "smartmoe") return "#59a14f";
  if (name == "fastermoe") return "#b07aa1";
  if (name == "velb") return "#76b7b2";
  if (name == "lplb") return "#edc948";
  if (name == "swiftmoe") return "#9c755f";
  if (name == "trtllm") return "#ff9da7";
  if (name == "keel") return "#e15759";
  static constexpr std::array<const char*, 4> kOthers = {"#17becf", "#bcbd22", "#7f7f7f",
                                                         "#1f77b4"};
  return kOthers[index % kOthers.size()];
}

std::string Escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Num(double value, int decimals = 1) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks.
double TickStep(double range, int target) {
  if (!(range > 0)) return 1;
  const double raw = range / target;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

int TickDecimals(double step) {
  return step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
}

// Averages `series` ([num_steps]) into `columns` buckets of consecutive steps.
std::vector<double> Downsample(const std::vector<double>& series, int columns) {
  const int steps = static_cast<int>(series.size());
  std::vector<double> out(columns, 0.0);
  for (int c = 0; c < columns; ++c) {
    const int begin = static_cast<int>(static_cast<long>(c) * steps / columns);
    const int end =
        std::max(begin + 1, static_cast<int>(static_cast<long>(c + 1) * steps / columns));
    double sum = 0;
    for (int s = begin; s < end; ++s) sum += series[s];
    out[c] = sum / (end - begin);
  }
  return out;
}

class Svg {
 public:
  void Text(double x, double y, std::string_view text, double size = 12,
            std::string_view anchor = "start", std::string_view extra = "") {
    out_ += "<text x=\"" + Num(x) + "\" y=\"" + Num(y) + "\" font-size=\"" + Num(size) +
            "\" text-anchor=\"" + std::string(anchor) + "\"" +
            (extra.empty() ? "" : " " + std::string(extra)) + ">" + Escape(text) + "</text>\n";
  }
  void Line(double x1, double y1, double x2, double y2, std::string_view stroke, double width,
            std::string_view extra = "") {
    out_ += "<line x1=\"" + Num(x1) + "\" y1=\"" + Num(y1) + "\" x2=\"" + Num(x2) + "\" y2=\"" +
            Num(y2) + "\" stroke=\"" + std::string(stroke) + "\" stroke-width=\"" + Num(width) +
            "\"" + (extra.empty() ? "" : " " + std::string(extra)) + "/>\n";
  }
  void Rect(double x, double y, double w, double h, std::string_view fill,
            std::string_view extra = "") {
    out_ += "<rect x=\"" + Num(x, 2) + "\" y=\"" + Num(y, 2) + "\" width=\"" + Num(w, 2) +
            "\" height=\"" + Num(h, 2) + "\" fill=\"" + std::string(fill) + "\"" +
            (extra.empty() ? "" : " " + std::string(extra)) + "/>\n";
  }
  void Raw(std::string_view text) { out_ += text; }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

// Step axis ticks under a panel spanning [top, bottom].
void StepAxis(Svg& svg, int steps, double bottom, bool labels) {
  const double step = std::max(1.0, TickStep(std::max(1, steps - 1), 8));
  for (double s = 0; s <= steps - 1 + 1e-9; s += step) {
    const double x = kLeft + (s + 0.5) / steps * (kRight - kLeft);
    svg.Line(x, bottom, x, bottom + 5, "#444", 1);
    if (labels) svg.Text(x, bottom + 18, Num(s, 0), 11, "middle", "fill=\"#333\"");
  }
}

// The line drawn boldest and on top: Keel's own policy, or the strategy that chooses.
bool Highlighted(const std::string& name) { return name == "keel" || name == "auto"; }

void LinePanel(Svg& svg, const ReplayReport& report, PlotLines what, double top, double bottom,
               int columns) {
  const bool imbalance = what == PlotLines::kImbalance;
  const int steps = report.num_steps;
  std::vector<std::vector<double>> lines;
  double high = imbalance ? 1.0 : 0.0;
  for (const PolicyReplay& p : report.policies) {
    std::vector<double> series = p.step_imbalance;
    if (!imbalance) {
      series = p.step_seconds;
      for (double& v : series) v *= 1e3;
    }
    lines.push_back(Downsample(series, columns));
    for (double v : lines.back()) high = std::max(high, v);
  }
  // Imbalance is drawn from perfect balance (1.0) up, step times from zero.
  const double base = imbalance ? 1.0 : 0.0;
  const double tick = TickStep(std::max(high - base, imbalance ? 0.05 : 1e-3), 5);
  high = base + std::ceil((high - base) / tick + 1e-9) * tick;
  // A little room under the base keeps a line that sits on it off the frame.
  const double low = base - 0.03 * (high - base);
  auto y_of = [&](double v) { return bottom - (v - low) / (high - low) * (bottom - top); };
  auto x_of = [&](int c) { return kLeft + (c + 0.5) / columns * (kRight - kLeft); };

  svg.Rect(kLeft, top, kRight - kLeft, bottom - top, "#fbfbfb", "stroke=\"#ccc\"");
  const int decimals = TickDecimals(tick);
  for (double v = base; v <= high + 1e-9; v += tick) {
    const double y = y_of(v);
    if (v > base + 1e-9) svg.Line(kLeft, y, kRight, y, "#e6e6e6", 1);
    svg.Line(kLeft - 5, y, kLeft, y, "#444", 1);
    svg.Text(kLeft - 8, y + 4, Num(v, std::max(1, decimals)), 11, "end", "fill=\"#333\"");
  }
  // Perfect balance: every rank computes the same number of tokens.
  if (imbalance) {
    svg.Line(kLeft, y_of(1.0), kRight, y_of(1.0), "#222", 1.2, "stroke-dasharray=\"6 4\"");
  }

  // Draw the first line (usually the static baseline) underneath, the highlighted one last and
  // on top.
  std::vector<size_t> order(report.policies.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(),
                        [&](size_t i) { return !Highlighted(report.policies[i].name); });
  for (size_t i : order) {
    const bool highlight = Highlighted(report.policies[i].name);
    std::string points;
    for (int c = 0; c < columns; ++c) {
      points += Num(x_of(c), 1) + "," + Num(y_of(lines[i][c]), 1) + " ";
    }
    svg.Raw("<polyline fill=\"none\" stroke=\"" + PolicyColor(report.policies[i].name, i) +
            "\" stroke-width=\"" + (highlight ? std::string("2.2") : std::string("1.4")) +
            "\" stroke-linejoin=\"round\" stroke-opacity=\"0.9\" points=\"" + points + "\"/>\n");
  }
  StepAxis(svg, steps, bottom, true);
  svg.Text(kLeft + (kRight - kLeft) / 2, bottom + 36, "step", 12, "middle", "fill=\"#333\"");
  svg.Text(20, (top + bottom) / 2,
           imbalance ? "imbalance (max / mean rank load)" : "simulated step (ms)", 12, "middle",
           "fill=\"#333\" transform=\"rotate(-90 20 " + Num((top + bottom) / 2) + ")\"");

  // Legend: each line's color, name and mean over the whole trace.
  double y = top + 8;
  svg.Text(kRight + 16, y + 4, imbalance ? "policy  (mean)" : "strategy  (mean ms)", 11, "start",
           "fill=\"#555\"");
  for (size_t i = 0; i < report.policies.size(); ++i) {
    y += 20;
    const PolicyReplay& p = report.policies[i];
    const bool highlight = Highlighted(p.name);
    svg.Line(kRight + 16, y, kRight + 40, y, PolicyColor(p.name, i), highlight ? 3 : 2.2);
    svg.Text(kRight + 46, y + 4, p.name, 12, "start", highlight ? "font-weight=\"bold\"" : "");
    svg.Text(kWidth - 12, y + 4,
             imbalance ? Num(p.imbalance.mean, 3) : Num(p.sim_step_seconds.mean * 1e3, 2), 12,
             "end", "fill=\"#333\"");
  }
  if (imbalance) {
    y += 26;
    svg.Line(kRight + 16, y, kRight + 40, y, "#222", 1.2, "stroke-dasharray=\"6 4\"");
    svg.Text(kRight + 46, y + 4, "perfect balance", 11, "start", "fill=\"#333\"");
  }
}

void HeatmapPanel(Svg& svg, const ReplayReport& report, double top, double bottom, int columns) {
  const int steps = report.num_steps;
  const int experts = report.num_experts;
  // [experts][columns] mean share per column.
  std::vector<std::vector<double>> cells(experts);
  std::vector<double> all;
  for (int e = 0; e < experts; ++e) {
    std::vector<double> series(steps);
    for (int s = 0; s < steps; ++s) {
      series[s] = report.expert_share[static_cast<size_t>(s) * experts + e];
    }
    cells[e] = Downsample(series, columns);
    all.insert(all.end(), cells[e].begin(), cells[e].end());
  }
  // The color scale tops out at the 99.5th percentile so that a few bursts do not wash out the
  // rest; cells above it take the top color.
  std::sort(all.begin(), all.end());
  double top_share = all.empty() ? 1.0 : all[static_cast<size_t>(0.995 * (all.size() - 1))];
  if (!(top_share > 0)) top_share = 1.0;

  const double cell_w = (kRight - kLeft) / columns;
  const double cell_h = (bottom - top) / experts;
  svg.Raw("<g shape-rendering=\"crispEdges\">\n");
  for (int e = 0; e < experts; ++e) {
    // Neighbouring cells with the same quantized color merge into one rectangle.
    constexpr int kLevels = 96;
    int run_start = 0;
    int run_level = -1;
    auto flush = [&](int end) {
      if (run_level < 0) return;
      svg.Rect(kLeft + run_start * cell_w, top + e * cell_h, (end - run_start) * cell_w + 0.3,
               cell_h + 0.3, Hex(Viridis((run_level + 0.5) / kLevels)));
    };
    for (int c = 0; c < columns; ++c) {
      const int level = std::min(kLevels - 1, static_cast<int>(cells[e][c] / top_share * kLevels));
      if (level != run_level) {
        flush(c);
        run_start = c;
        run_level = level;
      }
    }
    flush(columns);
  }
  svg.Raw("</g>\n");
  svg.Rect(kLeft, top, kRight - kLeft, bottom - top, "none", "stroke=\"#888\"");

  const int label_every = std::max(1, static_cast<int>(std::ceil(14.0 / cell_h)));
  for (int e = 0; e < experts; e += label_every) {
    const double y = top + (e + 0.5) * cell_h;
    svg.Line(kLeft - 4, y, kLeft, y, "#444", 1);
    svg.Text(kLeft - 7, y + 4, std::to_string(e), 10, "end", "fill=\"#333\"");
  }
  StepAxis(svg, steps, bottom, true);
  svg.Text(kLeft + (kRight - kLeft) / 2, bottom + 36, "step", 12, "middle", "fill=\"#333\"");
  svg.Text(26, (top + bottom) / 2, "expert", 12, "middle",
           "fill=\"#333\" transform=\"rotate(-90 26 " + Num((top + bottom) / 2) + ")\"");

  // Color bar with percentage ticks.
  const double bar_x = kRight + 16;
  const double bar_w = 16;
  svg.Raw("<defs><linearGradient id=\"viridis\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">\n");
  for (int i = 0; i <= 8; ++i) {
    svg.Raw("<stop offset=\"" + Num(i / 8.0, 3) + "\" stop-color=\"" + Hex(Viridis(i / 8.0)) +
            "\"/>\n");
  }
  svg.Raw("</linearGradient></defs>\n");
  svg.Rect(bar_x, top, bar_w, bottom - top, "url(#viridis)", "stroke=\"#888\"");
  const double top_percent = top_share * 100;
  const double tick = TickStep(top_percent, 4);
  for (double v = 0; v <= top_percent + 1e-9; v += tick) {
    const double y = bottom - v / top_percent * (bottom - top);
    svg.Line(bar_x + bar_w, y, bar_x + bar_w + 4, y, "#444", 1);
    svg.Text(bar_x + bar_w + 7, y + 4, Num(v, TickDecimals(tick)) + "%", 10, "start",
             "fill=\"#333\"");
  }
  svg.Text(bar_x, top - 8, "share of tokens", 11, "start", "fill=\"#555\"");
}

}  // namespace

std::string RenderReplaySvg(const ReplayReport& report, PlotLines lines) {
  const int steps = std::max(1, report.num_steps);
  const int columns = std::min(steps, kMaxColumns);
  const int experts = std::max(1, report.num_experts);
  const double line_top = 92;
  const double line_bottom = 352;
  const double heat_top = 436;
  const double heat_bottom = heat_top + std::clamp(experts * 9.0, 180.0, 330.0);
  const double height = heat_bottom + 52;

  Svg svg;
  svg.Raw(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"" +
      Num(kWidth, 0) + "\" height=\"" + Num(height, 0) + "\" viewBox=\"0 0 " + Num(kWidth, 0) +
      " " + Num(height, 0) + "\" font-family=\"" + kFont + "\">\n");
  svg.Rect(0, 0, kWidth, height, "white");

  const KeelConfig& c = report.config;
  std::string title = "Replay: " + (report.trace_description.empty() ? std::string("trace")
                                                                     : report.trace_description);
  // Long descriptions are cut so the title stays inside the picture.
  if (title.size() > 88) title = title.substr(0, 85) + "...";
  svg.Text(kLeft, 28, title, 17, "start", "font-weight=\"bold\" fill=\"#111\"");
  std::string subtitle =
      std::to_string(report.num_steps) + " steps, " + std::to_string(report.num_layers) +
      " layers, " + std::to_string(report.num_experts) + " experts on " +
      std::to_string(c.topology.num_nodes) + " x " + std::to_string(c.topology.gpus_per_node) +
      " GPUs, " + std::to_string(c.slots.persistent_per_rank) + " slots per GPU; " +
      (report.oracle ? "oracle (plans see the step's own load)"
                     : "causal (plans see only earlier steps)");
  svg.Text(kLeft, 48, subtitle, 12, "start", "fill=\"#555\"");

  std::string panel1 = lines == PlotLines::kImbalance
                           ? "Imbalance per step (mean over layers)"
                           : "Simulated step time per strategy (all layers)";
  if (columns < steps) panel1 += ", " + std::to_string(steps) + " steps averaged into columns";
  svg.Text(kLeft, line_top - 12, panel1, 14, "start", "font-weight=\"bold\" fill=\"#222\"");
  LinePanel(svg, report, lines, line_top, line_bottom, columns);

  const std::string which = report.heatmap_layer >= 0
                                ? "layer " + std::to_string(report.heatmap_layer)
                                : std::string("all layers");
  svg.Text(kLeft, heat_top - 12, "Expert load: each expert's share of the tokens (" + which + ")",
           14, "start", "font-weight=\"bold\" fill=\"#222\"");
  HeatmapPanel(svg, report, heat_top, heat_bottom, columns);

  svg.Raw("</svg>\n");
  return std::move(svg.str());
}

Status WriteReplaySvg(const ReplayReport& report, const std::string& path, PlotLines lines) {
  return WriteFileAtomically(path, RenderReplaySvg(report, lines));
}

}  // namespace keel::tools
