//! The report as people read it: the side-by-side table and the SVG plot.

use std::fmt::Write;

use super::RunReport;

/// The side-by-side table.
pub fn table(runs: &[RunReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<19} {:>9} {:>9} {:>9} {:>8} {:>9} {:>10} {:>9} {:>7} {:>9} {:>8} {:>10}",
        "policy",
        "ttft p50",
        "ttft p95",
        "ttft p99",
        "itl p50",
        "e2e p50",
        "in tok/s",
        "out tok/s",
        "hit",
        "evictions",
        "preempt",
        "max share"
    );
    for r in runs {
        let max_share = r.per_server.iter().map(|s| s.share).fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "{:<19} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>9.1} {:>10.0} {:>9.0} {:>6.1}% {:>9} {:>8} {:>9.1}%",
            r.policy,
            r.ttft_ms.p50,
            r.ttft_ms.p95,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.e2e_ms.p50,
            r.throughput.input_tok_s,
            r.throughput.output_tok_s,
            r.prefix_hit_rate * 100.0,
            r.evictions,
            r.preemptions,
            max_share * 100.0
        );
    }
    let _ = writeln!(out, "(latencies in ms; completed/failed per run are in the JSON)");
    out
}

pub(crate) const COLORS: [&str; 9] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
];

const W: f64 = 1100.0;
const H: f64 = 460.0;
const PAD: f64 = 50.0;
const PLOT_W: f64 = 600.0;

/// TTFT CDFs (log-scale x) on the left, requests per server per policy on the right.
pub fn svg(title: &str, runs: &[RunReport]) -> String {
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{PAD}\" y=\"24\" font-size=\"15\">{}</text>\n",
        xml(title)
    );
    cdf_panel(&mut s, runs);
    share_panel(&mut s, runs);
    for p in [0.0, 0.5, 0.9, 0.99] {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{p}</text>",
            PAD - 4.0,
            y_of(p) + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The height of fraction `p` in the CDF panel.
fn y_of(p: f64) -> f64 {
    H - PAD - p * (H - 2.0 * PAD)
}

/// Each run's TTFT CDF on a log-scale x axis, with its legend.
fn cdf_panel(s: &mut String, runs: &[RunReport]) {
    let all: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.ttft_cdf_ms.iter().copied())
        .filter(|v| *v > 0.0)
        .collect();
    let (lo, hi) = (
        all.iter().copied().fold(f64::MAX, f64::min).max(0.1),
        all.iter().copied().fold(1.0, f64::max),
    );
    let (lx, hx) = (lo.log10().floor(), hi.log10().ceil().max(lo.log10().floor() + 1.0));
    let x = |v: f64| PAD + (v.max(lo).log10() - lx) / (hx - lx) * PLOT_W;
    let _ = writeln!(
        s,
        "<rect x=\"{PAD}\" y=\"{PAD}\" width=\"{PLOT_W}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
        H - 2.0 * PAD
    );
    let mut decade = lx;
    while decade <= hx {
        let v = 10f64.powf(decade);
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x(v),
            H - PAD + 16.0,
            v
        );
        decade += 1.0;
    }
    let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">TTFT (ms, log scale): fraction of requests at or below</text>", PAD + PLOT_W / 2.0, H - 12.0);
    for (i, r) in runs.iter().enumerate() {
        let n = (r.ttft_cdf_ms.len().max(2) - 1) as f64;
        let points: Vec<String> = r
            .ttft_cdf_ms
            .iter()
            .enumerate()
            .map(|(k, v)| format!("{:.1},{:.1}", x(*v), y_of(k as f64 / n)))
            .collect();
        let c = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{c}\">{}</text>",
            PAD + 8.0,
            PAD + 16.0 + 15.0 * i as f64,
            xml(&r.policy)
        );
    }
}

/// One row of bars per run: its requests per server, scaled to its busiest server.
fn share_panel(s: &mut String, runs: &[RunReport]) {
    let bx = PAD + PLOT_W + 60.0;
    let bw = W - bx - PAD;
    let _ = writeln!(
        s,
        "<text x=\"{bx}\" y=\"{}\">requests per server (share of each run)</text>",
        PAD - 8.0
    );
    for (i, r) in runs.iter().enumerate() {
        let row_y = PAD + 6.0 + i as f64 * ((H - 2.0 * PAD) / runs.len().max(1) as f64);
        let servers = r.per_server.len().max(1) as f64;
        // Bars scale to the run's busiest server; the label gives the shares.
        let top = r.per_server.iter().map(|s| s.share).fold(0.0, f64::max).max(1e-9);
        for (k, st) in r.per_server.iter().enumerate() {
            let bh = st.share / top * 30.0;
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"/>",
                bx + k as f64 * bw / servers,
                row_y + 30.0 - bh,
                bw / servers - 2.0,
                bh,
                COLORS[i % COLORS.len()]
            );
        }
        let shares: Vec<String> = r
            .per_server
            .iter()
            .map(|s| format!("{:.0}%", s.share * 100.0))
            .collect();
        let _ = writeln!(
            s,
            "<text x=\"{bx}\" y=\"{:.1}\" font-size=\"10\">{}: {}</text>",
            row_y + 41.0,
            xml(&r.policy),
            shares.join(" ")
        );
    }
}

pub(crate) fn xml(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
