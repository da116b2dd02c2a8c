//! `plan`'s output: the side-by-side table of the fleet each policy needs, a text chart of
//! objective attainment against fleet size for stdout, and the same as an SVG (drawn the
//! way `report::svg` draws, by hand, without a plotting dependency).

use std::fmt::Write;

use super::{gpu_name, Objective, Point, Sizing};
use crate::report::{xml, COLORS};

/// The share of requests a p95 objective needs within its thresholds.
pub const TARGET: f64 = 0.95;

/// One evaluated size in a line (progress and the text chart).
pub fn describe(p: &Point, obj: &Objective) -> String {
    let verdict = if p.meets { "meets" } else { "misses" };
    if p.ttft_p95_ms.is_none() {
        return format!(
            "{} servers: {verdict} (stopped early; about {:.1}% of the requests completed by then within the objective)",
            p.servers,
            p.attainment * 100.0
        );
    }
    let itl = match (obj.itl_p95_ms, p.itl_p95_ms) {
        (Some(_), Some(v)) => format!(", ITL p95 {v:.1} ms"),
        _ => String::new(),
    };
    format!(
        "{} servers: {verdict}: TTFT p95 {:.0} ms{itl}, {:.1}% within the objective, hit rate {:.1}%{}",
        p.servers,
        p.ttft_p95_ms.unwrap_or(0.0),
        p.attainment * 100.0,
        p.hit_rate.unwrap_or(0.0) * 100.0,
        stopped_note(p)
    )
}

/// Medians cover only the replicas that ran to the end: say when some did not.
fn stopped_note(p: &Point) -> String {
    if p.stopped_early == 0 {
        return String::new();
    }
    format!(
        " ({} of {} replicas stopped early, missing; figures from the others)",
        p.stopped_early, p.replicas
    )
}

/// The objective in words (`TTFT p95 ≤ 500 ms, ITL p95 ≤ 50 ms`).
pub fn objective_text(obj: &Objective) -> String {
    let mut s = format!("TTFT p95 ≤ {} ms", obj.ttft_p95_ms);
    if let Some(y) = obj.itl_p95_ms {
        let _ = write!(s, ", ITL p95 ≤ {y} ms");
    }
    s
}

/// Policy, GPU, servers, GPUs, latency and hit rate at that size, $/month and $/Mtok (of
/// sizings `priced` first).
pub fn table(sizings: &[Sizing], max_servers: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<19} {:<9} {:>7} {:>5} {:>10} {:>9} {:>6} {:>11} {:>8}  note",
        "policy", "gpu", "servers", "GPUs", "TTFT p95", "ITL p95", "hit", "$/month", "$/Mtok"
    );
    for s in sizings {
        let head = format!("{:<19} {:<9}", s.policy.to_string(), gpu_name(s.gpu));
        let (Some(p), Some(cost)) = (s.answer(), s.cost) else {
            let _ = writeln!(out, "{head} {:>7}  not met up to {max_servers} servers", "—");
            continue;
        };
        let note = if s.larger_needed {
            "a smaller size passed but one server more failed: a larger size was needed"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{head} {:>7} {:>5} {:>7.0} ms {:>6.1} ms {:>5.1}% {:>11.0} {:>8.4}  {note}",
            p.servers,
            p.servers as u64 * u64::from(s.tp),
            p.ttft_p95_ms.unwrap_or(0.0),
            p.itl_p95_ms.unwrap_or(0.0),
            p.hit_rate.unwrap_or(0.0) * 100.0,
            cost.usd_per_month,
            cost.usd_per_mtok
        );
    }
    out
}

/// Per policy and GPU, one bar per evaluated size: the share of requests within the
/// objective on a scale from `lo` (a round 10% below the lowest share) to 100%, with the 95%
/// target marked `|`, and the TTFT p95 beside it.
pub fn text_chart(sizings: &[Sizing], obj: &Objective) -> String {
    const WIDTH: usize = 40;
    let lowest = sizings
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.attainment))
        .fold(TARGET, f64::min);
    let lo = ((lowest * 10.0).floor() / 10.0).clamp(0.0, 0.9);
    let col = |a: f64| ((a.clamp(lo, 1.0) - lo) / (1.0 - lo) * WIDTH as f64).round() as usize;
    let target_col = col(TARGET).min(WIDTH - 1);
    let mut out = format!(
        "Share of requests within the objective ({}), bars from {:.0}% to 100%; `|` = the {:.0}% a p95 needs; `~` = estimated from the requests completed before the replay stopped early:\n",
        objective_text(obj),
        lo * 100.0,
        TARGET * 100.0
    );
    for s in sizings {
        let _ = writeln!(out, "{} on {} (tp {}):", s.policy, gpu_name(s.gpu), s.tp);
        for p in &s.points {
            let filled = col(p.attainment);
            let bar: String = (0..WIDTH)
                .map(|i| match i {
                    _ if i < filled => '#',
                    _ if i == target_col => '|',
                    _ => ' ',
                })
                .collect();
            let bound = if p.ttft_p95_ms.is_none() { "~" } else { " " };
            let mark = if Some(p.servers) == s.servers {
                "  ← answer"
            } else {
                ""
            };
            let p95 = p.ttft_p95_ms.map_or("stopped early".to_string(), |v| {
                format!("TTFT p95 {v:.0} ms{}", stopped_note(p))
            });
            let _ = writeln!(
                out,
                "  {:>4} [{bar}] {bound}{:>5.1}% {:<6} {p95}{mark}",
                p.servers,
                p.attainment * 100.0,
                if p.meets { "meets" } else { "misses" }
            );
        }
    }
    out
}

/// Attainment against fleet size, one line per policy and GPU, the target dashed; hollow
/// points are estimates (the replay stopped early), a ring marks each answer.
pub fn svg(title: &str, sizings: &[Sizing], obj: &Objective) -> String {
    let f = Frame::fitting(sizings);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"24\" font-size=\"15\">{}</text>\n",
        f.w,
        f.h,
        f.pad,
        xml(title)
    );
    f.axes(&mut s, obj);
    for (i, sz) in sizings.iter().enumerate() {
        f.series(&mut s, i, sz);
    }
    s.push_str("</svg>\n");
    s
}

/// The plot's geometry: servers on x (0 to the largest evaluated), attainment on y (from
/// 50%, or 0% when a point lies below it, to 100%).
struct Frame {
    w: f64,
    h: f64,
    pad: f64,
    plot_w: f64,
    plot_h: f64,
    max_n: f64,
    y0: f64,
}

impl Frame {
    fn fitting(sizings: &[Sizing]) -> Frame {
        let (w, h, pad, legend_w) = (900.0, 460.0, 55.0, 230.0);
        let points = || sizings.iter().flat_map(|s| s.points.iter());
        let max_n = points().map(|p| p.servers).max().unwrap_or(1).max(2) as f64;
        let lowest = points().map(|p| p.attainment).fold(1.0, f64::min);
        Frame {
            w,
            h,
            pad,
            plot_w: w - 2.0 * pad - legend_w,
            plot_h: h - 2.0 * pad,
            max_n,
            y0: if lowest >= 0.5 { 0.5 } else { 0.0 },
        }
    }

    fn x(&self, n: f64) -> f64 {
        self.pad + n / self.max_n * self.plot_w
    }

    fn y(&self, a: f64) -> f64 {
        self.h - self.pad - (a.max(self.y0) - self.y0) / (1.0 - self.y0) * self.plot_h
    }

    /// The frame, tick labels, the dashed target and the axis title.
    fn axes(&self, s: &mut String, obj: &Objective) {
        let (pad, h, plot_w) = (self.pad, self.h, self.plot_w);
        let _ = writeln!(
            s,
            "<rect x=\"{pad}\" y=\"{pad}\" width=\"{plot_w}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
            self.plot_h
        );
        for tick in 0..=4 {
            let a = self.y0 + (1.0 - self.y0) * f64::from(tick) / 4.0;
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.0}%</text>",
                pad - 4.0,
                self.y(a) + 4.0,
                a * 100.0
            );
        }
        let step = (self.max_n / 8.0).ceil().max(1.0);
        let mut n = 0.0;
        while n <= self.max_n {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{n}</text>",
                self.x(n),
                h - pad + 16.0
            );
            n += step;
        }
        let ty = self.y(TARGET);
        let _ = writeln!(
            s,
            "<line x1=\"{pad}\" x2=\"{:.1}\" y1=\"{ty:.1}\" y2=\"{ty:.1}\" stroke=\"#555\" stroke-dasharray=\"6 4\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">target {:.0}%</text>",
            pad + plot_w,
            pad + plot_w - 4.0,
            ty - 5.0,
            TARGET * 100.0
        );
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">servers: share of requests within {}</text>",
            pad + plot_w / 2.0,
            h - 14.0,
            xml(&objective_text(obj))
        );
    }

    /// Sizing `i`: its line, its points (hollow when estimated), a ring at its answer and
    /// its legend entry.
    fn series(&self, s: &mut String, i: usize, sz: &Sizing) {
        let c = COLORS[i % COLORS.len()];
        let at = |p: &Point| (self.x(p.servers as f64), self.y(p.attainment));
        let line: Vec<String> = sz
            .points
            .iter()
            .map(|p| {
                let (px, py) = at(p);
                format!("{px:.1},{py:.1}")
            })
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            line.join(" ")
        );
        for p in &sz.points {
            let fill = if p.ttft_p95_ms.is_none() { "white" } else { c };
            let (px, py) = at(p);
            let _ = writeln!(
                s,
                "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"3.5\" fill=\"{fill}\" stroke=\"{c}\"/>"
            );
            if Some(p.servers) == sz.servers {
                let _ = writeln!(
                    s,
                    "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"8\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"/>"
                );
            }
        }
        let answer = sz.servers.map_or("not met".to_string(), |n| format!("{n} servers"));
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{c}\">{} on {}: {answer}</text>",
            self.pad + self.plot_w + 14.0,
            self.pad + 14.0 + 16.0 * i as f64,
            xml(&sz.policy.to_string()),
            gpu_name(sz.gpu)
        );
    }
}
