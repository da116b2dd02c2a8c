//! What `plan` is asked for: the latency objective, the GPUs' prices, and the cost
//! arithmetic (see the module note of `plan`).

use std::str::FromStr;

use serde::Serialize;

use crate::profile::Gpu;
use crate::report::Record;

/// A size fails when more than this fraction of its requests did not complete.
pub const MAX_FAILED: f64 = 0.01;
pub const HOURS_PER_MONTH: f64 = 730.0;

/// TTFT p95 ≤ `ttft_p95_ms`, and ITL p95 ≤ `itl_p95_ms` when given.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Objective {
    pub ttft_p95_ms: f64,
    pub itl_p95_ms: Option<f64>,
}

impl FromStr for Objective {
    type Err = String;

    /// `ttft_p95=500ms[,itl_p95=50ms]`; durations in `ms` or `s`.
    fn from_str(spec: &str) -> Result<Objective, String> {
        let mut ttft = None;
        let mut itl = None;
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected KEY=DURATION, e.g. ttft_p95=500ms"))?;
            let ms = duration_ms(value.trim()).map_err(|why| format!("{part:?}: {why}"))?;
            let slot = match key.trim() {
                "ttft_p95" => &mut ttft,
                "itl_p95" => &mut itl,
                other => return Err(format!("unknown objective {other:?}: use ttft_p95 and itl_p95")),
            };
            if slot.replace(ms).is_some() {
                return Err(format!("{key} is given twice"));
            }
        }
        Ok(Objective {
            ttft_p95_ms: ttft.ok_or("no ttft_p95: e.g. --objective ttft_p95=500ms,itl_p95=50ms")?,
            itl_p95_ms: itl,
        })
    }
}

/// `500ms`, `0.5s` → 500.
fn duration_ms(v: &str) -> Result<f64, String> {
    let (number, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        return Err(format!("{v:?} has no unit: write e.g. 500ms or 0.5s"));
    };
    match number.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x * scale),
        _ => Err(format!("{v:?} is not a positive duration")),
    }
}

/// The CLI name of a GPU (`h100-80g`).
pub fn gpu_name(gpu: Gpu) -> String {
    use clap::ValueEnum;
    gpu.to_possible_value()
        .map_or_else(|| format!("{gpu:?}"), |v| v.get_name().to_string())
}

/// USD per GPU-hour of each GPU type.
#[derive(Clone, Debug, PartialEq)]
pub struct Prices(Vec<(Gpu, f64)>);

impl Prices {
    /// The price of `gpu` (0 when not priced: `parse` checks every GPU sized has one).
    pub fn of(&self, gpu: Gpu) -> f64 {
        self.0.iter().find(|(g, _)| *g == gpu).map_or(0.0, |(_, p)| *p)
    }

    pub fn iter(&self) -> impl Iterator<Item = &(Gpu, f64)> {
        self.0.iter()
    }

    /// From `h100-80g=2.49,a100-80g=1.29`, checked to cover every GPU in `needed`.
    pub fn parse(spec: &str, needed: &[Gpu]) -> Result<Prices, String> {
        use clap::ValueEnum;
        let mut out: Vec<(Gpu, f64)> = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (gpu, price) = part
                .split_once('=')
                .ok_or_else(|| format!("--price {part:?}: expected GPU=USD_PER_GPU_HOUR, e.g. h100-80g=2.49"))?;
            let known: Vec<String> = Gpu::value_variants().iter().map(|g| gpu_name(*g)).collect();
            let gpu = Gpu::from_str(gpu.trim(), true)
                .map_err(|_| format!("--price: unknown GPU {:?} (known: {})", gpu.trim(), known.join(", ")))?;
            let price: f64 = match price.trim().parse() {
                Ok(p) if f64::is_finite(p) && p > 0.0 => p,
                _ => {
                    return Err(format!(
                        "--price {part:?}: the price must be a positive number of USD per GPU-hour"
                    ))
                }
            };
            if out.iter().any(|(g, _)| *g == gpu) {
                return Err(format!("--price: {} is priced twice", gpu_name(gpu)));
            }
            out.push((gpu, price));
        }
        for gpu in needed {
            if !out.iter().any(|(g, _)| g == gpu) {
                let name = gpu_name(*gpu);
                return Err(format!("--price has no price for {name}: add {name}=USD_PER_GPU_HOUR"));
            }
        }
        Ok(Prices(out))
    }
}

/// What a fleet of `gpus` GPUs at `usd_per_gpu_hour` costs: per month of 730 h, and per
/// million of the `tokens` it processed in `busy_s` seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Cost {
    pub usd_per_month: f64,
    pub usd_per_mtok: f64,
}

impl Cost {
    pub fn of(gpus: u64, usd_per_gpu_hour: f64, busy_s: f64, tokens: u64) -> Cost {
        let per_hour = gpus as f64 * usd_per_gpu_hour;
        Cost {
            usd_per_month: per_hour * HOURS_PER_MONTH,
            usd_per_mtok: per_hour * busy_s / 3600.0 / (tokens.max(1) as f64 / 1e6),
        }
    }
}

impl Objective {
    /// Whether one request met both thresholds.
    pub fn met_by(&self, r: &Record) -> bool {
        r.ttft_ms <= self.ttft_p95_ms && self.itl_p95_ms.is_none_or(|y| r.output_tokens <= 1 || r.itl_ms <= y)
    }
}
