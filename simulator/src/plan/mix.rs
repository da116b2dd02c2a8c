//! Fleets of two GPU types (`plan --mix`): some servers of a cheap type and some of a premium
//! one, and the cheapest such fleet that meets the objective.
//!
//! - Search (`staircase`): for each count of cheap servers c = 0, 1, 2, … the fewest premium
//!   servers q with which the fleet meets the objective (`search::smallest`), looking only at
//!   the counts that would cost less per hour than the cheapest fleet found so far. It stops
//!   once c cheap servers alone cost as much as that fleet, or once cheap servers alone meet
//!   the objective (more of them would only cost more). Where meeting the objective never gets
//!   worse with a server more of either type, the answer is the cheapest fleet of the whole
//!   grid (the tests check it against every fleet of a grid).
//! - Server order: the cheap servers first (the replay's `127.0.0.1:8001`, …), then the premium
//!   ones. Tiered (`tiered_config`), the premium servers are kvroute's tier 1, with each
//!   tier's sequence slots and the objective's TTFT as the tiers' objective unless the router
//!   configuration sets them.
//! - Cost: as `Sizing`'s, each server `tp` GPUs at its type's price.

use std::fmt::Write;

use serde::Serialize;

use super::search::{self, Outcome};
use super::{chart, gpu_name, Cost, Objective, Planner, Point, HOURS_PER_MONTH};
use crate::policies::{self, PolicyName};
use crate::profile::Profile;
use crate::replay::ReplaySetup;
use kvroute_core::Config;

/// One count of cheap servers and the fewest premium servers found to go with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Step {
    pub cheap: usize,
    /// `None`: no premium count below the cost bound (or up to the largest) met it.
    pub premium: Option<usize>,
    /// A smaller premium count passed but the count after it failed.
    pub larger_needed: bool,
}

/// The staircase of fleets that meet the objective (see the module note), `test(c, q)`
/// replaying c cheap and q premium servers. Prices per server-hour.
pub fn staircase(
    cheap_price: f64,
    premium_price: f64,
    max_premium: usize,
    max_cheap: usize,
    test: &mut dyn FnMut(usize, usize) -> bool,
) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut best: Option<f64> = None;
    for c in 0..=max_cheap {
        let cheap_cost = c as f64 * cheap_price;
        // Only fleets cheaper than the best so far: q premium servers with
        // c·cheap + q·premium < best.
        let most = match best {
            None => max_premium,
            Some(b) if cheap_cost >= b - 1e-9 => break,
            Some(b) => (((b - cheap_cost) / premium_price - 1e-9).ceil() as usize)
                .saturating_sub(1)
                .min(max_premium),
        };
        // With no cheap server the fleet needs one premium server at least.
        let least = usize::from(c == 0);
        if most < least {
            continue;
        }
        let found = search::smallest(most - least + 1, &mut |n| test(c, n - 1 + least));
        let step = match found.outcome {
            Outcome::Met { servers, larger_needed } => Step {
                cheap: c,
                premium: Some(servers - 1 + least),
                larger_needed,
            },
            Outcome::NotMet => Step {
                cheap: c,
                premium: None,
                larger_needed: false,
            },
        };
        steps.push(step);
        if let Some(q) = step.premium {
            let cost = cheap_cost + q as f64 * premium_price;
            best = Some(best.map_or(cost, |b| b.min(cost)));
            if q == 0 {
                break;
            }
        }
    }
    steps
}

/// The index of the step with the cheapest fleet (the fewest cheap servers among equals).
pub fn cheapest(steps: &[Step], cheap_price: f64, premium_price: f64) -> Option<usize> {
    steps
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((i, s.cheap as f64 * cheap_price + s.premium? as f64 * premium_price)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

/// kvroute's configuration for `cheap` servers of `cheap_profile` then `premium` of
/// `premium_profile`, tiered: the premium servers in tier 1. `base` is the router
/// configuration's JSON (an object; `tiers` settings it gives are kept, but its endpoints).
pub fn tiered_config(
    base: &serde_json::Value,
    cheap_profile: &Profile,
    premium_profile: &Profile,
    cheap: usize,
    premium: usize,
    objective: &Objective,
) -> Result<Config, String> {
    let mut doc = base.clone();
    let Some(root) = doc.as_object_mut() else {
        return Err("--tiered needs the router configuration to be a JSON object".into());
    };
    let tiers = root.entry("tiers").or_insert_with(|| serde_json::json!({}));
    let Some(tiers) = tiers.as_object_mut() else {
        return Err("the router configuration's `tiers` must be an object".into());
    };
    if tiers.get("from_priority").and_then(|v| v.as_bool()) == Some(true) {
        return Err("--tiered lists the premium servers itself: drop `tiers.from_priority`".into());
    }
    let endpoints: serde_json::Map<String, serde_json::Value> = (cheap..cheap + premium)
        .map(|i| (policies::endpoint_id(i).as_str().to_string(), serde_json::json!(1)))
        .collect();
    tiers.insert("endpoints".into(), endpoints.into());
    tiers
        .entry("ttft_objective_ms")
        .or_insert_with(|| serde_json::json!(objective.ttft_p95_ms));
    tiers
        .entry("max_num_seqs")
        .or_insert_with(|| serde_json::json!([cheap_profile.max_num_seqs, premium_profile.max_num_seqs]));
    Config::from_json(doc.to_string().as_bytes()).map_err(|e| format!("the tiered router configuration: {e}"))
}

/// One policy's search over fleets of two GPU types.
#[derive(Clone, Debug)]
pub struct MixTask {
    pub policy: PolicyName,
    /// kvroute with the premium servers as its tier 1 (`tiered_config`).
    pub tiered: bool,
}

impl MixTask {
    pub fn label(&self) -> String {
        if self.tiered {
            format!("{}+tiers", self.policy)
        } else {
            self.policy.to_string()
        }
    }
}

/// A fleet that met the objective, at the fewest premium servers for its cheap ones.
#[derive(Clone, Debug, Serialize)]
pub struct MixRow {
    pub cheap: usize,
    pub premium: usize,
    pub larger_needed: bool,
    pub usd_per_hour: f64,
    pub cost: Cost,
    pub point: Point,
}

/// What one `MixTask` found.
#[derive(Clone, Debug, Serialize)]
pub struct MixSizing {
    pub policy: String,
    pub tiered: bool,
    /// The fleets that met the objective, fewest cheap servers first.
    pub rows: Vec<MixRow>,
    /// Counts of cheap servers for which no premium count (below the cost bound) met it.
    pub not_met: Vec<usize>,
    /// The index in `rows` of the cheapest fleet per hour.
    pub cheapest: Option<usize>,
    /// Every fleet replayed: (cheap, premium, its point).
    pub evaluated: Vec<(usize, usize, Point)>,
}

/// The two GPU types of a mixed search, their prices per GPU-hour and the search's bounds.
pub struct Mix<'a> {
    pub cheap: &'a Profile,
    pub premium: &'a Profile,
    pub cheap_usd_per_gpu_hour: f64,
    pub premium_usd_per_gpu_hour: f64,
    pub max_premium: usize,
    pub max_cheap: usize,
    /// The router configuration's JSON (for the tiered configurations).
    pub config_json: &'a serde_json::Value,
}

impl Mix<'_> {
    fn server_prices(&self) -> (f64, f64) {
        (
            self.cheap_usd_per_gpu_hour * f64::from(self.cheap.tp),
            self.premium_usd_per_gpu_hour * f64::from(self.premium.tp),
        )
    }

    /// The replay setup of `c` cheap then `q` premium servers.
    fn fleet(&self, base: &ReplaySetup, task: &MixTask, objective: &Objective, c: usize, q: usize) -> ReplaySetup {
        let mut mixed = vec![self.cheap.clone(); c];
        mixed.extend(std::iter::repeat_n(self.premium.clone(), q));
        let router_config = if task.tiered {
            // Checked before the search (`plan_cmd`): only its endpoints change here.
            tiered_config(self.config_json, self.cheap, self.premium, c, q, objective)
                .unwrap_or_else(|_| base.router_config.clone())
        } else {
            base.router_config.clone()
        };
        ReplaySetup {
            classes: None,
            profile: mixed[0].clone(),
            servers: c + q,
            mixed,
            router_config,
            ..base.clone()
        }
    }
}

impl Planner<'_> {
    /// Every task's search over fleets of `mix`'s two types, `jobs` at a time.
    pub fn size_mixes(
        &self,
        tasks: &[MixTask],
        mix: &Mix,
        jobs: usize,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Vec<MixSizing> {
        super::in_parallel(tasks, jobs, &|task| self.size_mix(task, mix, progress))
    }

    /// One task's search (`staircase`), priced.
    pub fn size_mix(&self, task: &MixTask, mix: &Mix, progress: &(dyn Fn(&str) + Sync)) -> MixSizing {
        let (pc, pp) = mix.server_prices();
        let (cheap_name, premium_name) = (gpu_name(mix.cheap.gpu), gpu_name(mix.premium.gpu));
        let mut evaluated: Vec<(usize, usize, Point)> = Vec::new();
        let steps = staircase(pc, pp, mix.max_premium, mix.max_cheap, &mut |c, q| {
            let p = self.evaluate_fleet(task.policy, &mix.fleet(&self.base, task, &self.objective, c, q));
            let line = chart::describe(&p, &self.objective);
            let line = line
                .split_once(": ")
                .map_or(line.as_str(), |(_, rest)| rest)
                .to_string();
            progress(&format!(
                "{}: {c} {cheap_name} + {q} {premium_name}: {line}",
                task.label()
            ));
            let meets = p.meets;
            evaluated.push((c, q, p));
            meets
        });
        let mut rows = Vec::new();
        let mut not_met = Vec::new();
        for s in &steps {
            let Some(q) = s.premium else {
                not_met.push(s.cheap);
                continue;
            };
            let Some((_, _, point)) = evaluated.iter().find(|(c, p, _)| (*c, *p) == (s.cheap, q)) else {
                continue;
            };
            let usd_per_hour = s.cheap as f64 * pc + q as f64 * pp;
            rows.push(MixRow {
                cheap: s.cheap,
                premium: q,
                larger_needed: s.larger_needed,
                usd_per_hour,
                cost: Cost {
                    usd_per_month: usd_per_hour * HOURS_PER_MONTH,
                    usd_per_mtok: usd_per_hour * point.busy_s / 3600.0 / (point.tokens.max(1) as f64 / 1e6),
                },
                point: point.clone(),
            });
        }
        MixSizing {
            policy: task.label(),
            tiered: task.tiered,
            cheapest: rows
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.usd_per_hour.total_cmp(&b.1.usd_per_hour))
                .map(|(i, _)| i),
            rows,
            not_met,
            evaluated,
        }
    }
}

/// Each task's staircase (the fleets that met the objective, the cheapest marked) and a
/// summary line against the all-premium fleet.
pub fn table(sizings: &[MixSizing], cheap: &Profile, premium: &Profile) -> String {
    let (cn, pn) = (gpu_name(cheap.gpu), gpu_name(premium.gpu));
    let mut out = String::new();
    for s in sizings {
        let _ = writeln!(out, "{}:", s.policy);
        let _ = writeln!(
            out,
            "  {:>9} {:>9} {:>5} {:>8} {:>10} {:>8} {:>10} {:>7} {:>6}",
            cn, pn, "GPUs", "$/hour", "$/month", "$/Mtok", "TTFT p95", "within", "hit"
        );
        for (i, r) in s.rows.iter().enumerate() {
            let gpus = r.cheap as u64 * u64::from(cheap.tp) + r.premium as u64 * u64::from(premium.tp);
            let mark = if Some(i) == s.cheapest { "  ← cheapest" } else { "" };
            let note = if r.larger_needed {
                "  (a smaller count passed, one more failed)"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "  {:>9} {:>9} {:>5} {:>8.2} {:>10.0} {:>8.4} {:>7.0} ms {:>6.1}% {:>5.1}%{mark}{note}",
                r.cheap,
                r.premium,
                gpus,
                r.usd_per_hour,
                r.cost.usd_per_month,
                r.cost.usd_per_mtok,
                r.point.ttft_p95_ms.unwrap_or(0.0),
                r.point.attainment * 100.0,
                r.point.hit_rate.unwrap_or(0.0) * 100.0,
            );
        }
        if !s.not_met.is_empty() {
            let counts: Vec<String> = s.not_met.iter().map(|c| c.to_string()).collect();
            let _ = writeln!(
                out,
                "  not met with {} {cn} by any count of {pn} that would cost less than the fleets above",
                counts.join(", ")
            );
        }
        let fleet = |c: usize, q: usize| match (c, q) {
            (0, q) => format!("{q} {pn} alone"),
            (c, 0) => format!("{c} {cn} alone"),
            (c, q) => format!("{c} {cn} + {q} {pn}"),
        };
        let all_premium = s.rows.iter().find(|r| r.cheap == 0);
        match (s.cheapest.map(|i| &s.rows[i]), all_premium) {
            (None, _) => {
                let _ = writeln!(out, "  no fleet met the objective");
            }
            (Some(best), Some(base)) if best.cheap > 0 => {
                let _ = writeln!(
                    out,
                    "  cheapest: {}, {:.2}× the $/hour and {:.2}× the $/Mtok of {}",
                    fleet(best.cheap, best.premium),
                    best.usd_per_hour / base.usd_per_hour,
                    best.cost.usd_per_mtok / base.cost.usd_per_mtok,
                    fleet(0, base.premium)
                );
            }
            (Some(best), _) => {
                let _ = writeln!(out, "  cheapest: {}", fleet(best.cheap, best.premium));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
