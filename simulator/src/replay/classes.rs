//! Request classes in the replay: which tenant sent a request, its priority band and the
//! band's TTFT objective, for overload runs that check fairness (`--tenants`, `--priorities`,
//! `--objectives`).
//!
//! A tenant owns whole prefix families (a tenant's system prompt or documents): a request's
//! tenant follows from a hash of its first segment, so every request of one family has one
//! tenant. Its priority is drawn per request from a seeded hash of its index. Both are pure
//! functions of the workload and the seed: every policy sees the same classes.

use crate::policies::Rng;
use crate::workload::SimRequest;

#[derive(Clone, Debug, PartialEq)]
pub struct Classes {
    /// Each tenant's share of prefix families (sums to 1).
    pub tenants: Vec<f64>,
    /// `(priority, share of requests)`, shares summing to 1.
    pub bands: Vec<(i64, f64)>,
    /// `(priority, TTFT objective in ms)`: the objective the band's requests send (as
    /// kvroute's objective header); bands not listed send none.
    pub objectives: Vec<(i64, f64)>,
}

impl Classes {
    /// `tenants`: shares such as `0.7,0.1,0.1,0.1`; `priorities`: `PRIORITY:SHARE,…` such as
    /// `1:0.2,0:0.7,-1:0.1`. Shares are normalised.
    pub fn parse(tenants: &str, priorities: &str) -> anyhow::Result<Classes> {
        let shares = |v: Vec<f64>, what: &str| -> anyhow::Result<Vec<f64>> {
            anyhow::ensure!(
                !v.is_empty() && v.iter().all(|s| s.is_finite() && *s >= 0.0),
                "{what}: shares must be non-negative numbers"
            );
            let sum: f64 = v.iter().sum();
            anyhow::ensure!(sum > 0.0, "{what}: shares must not all be 0");
            Ok(v.iter().map(|s| s / sum).collect())
        };
        let t: Vec<f64> = tenants
            .split(',')
            .map(|s| s.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--tenants {tenants:?}: {e} (expected shares, e.g. 0.7,0.1,0.1,0.1)"))?;
        let mut bands = Vec::new();
        for part in priorities.split(',') {
            let (p, s) = part.split_once(':').ok_or_else(|| {
                anyhow::anyhow!("--priorities {priorities:?}: expected PRIORITY:SHARE,…, e.g. 1:0.2,0:0.7,-1:0.1")
            })?;
            let p: i64 = p
                .trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("--priorities {part:?}: {e}"))?;
            let s: f64 = s
                .trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("--priorities {part:?}: {e}"))?;
            bands.push((p, s));
        }
        let band_shares = shares(bands.iter().map(|b| b.1).collect(), "--priorities")?;
        Ok(Classes {
            tenants: shares(t, "--tenants")?,
            bands: bands.iter().zip(band_shares).map(|((p, _), s)| (*p, s)).collect(),
            objectives: Vec::new(),
        })
    }

    /// Each band's TTFT objective, `PRIORITY:MS,…` such as `1:2000,0:10000,-1:30000`.
    pub fn with_objectives(mut self, objectives: &str) -> anyhow::Result<Classes> {
        let usage = "expected PRIORITY:MS,…, e.g. 1:2000,0:10000,-1:30000";
        for part in objectives.split(',') {
            let (p, ms) = part
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("--objectives {objectives:?}: {usage}"))?;
            let p: i64 = p
                .trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("--objectives {part:?}: {e} ({usage})"))?;
            let ms: f64 = ms
                .trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("--objectives {part:?}: {e} ({usage})"))?;
            anyhow::ensure!(
                ms.is_finite() && ms > 0.0,
                "--objectives {part:?}: an objective must be a positive number of ms"
            );
            anyhow::ensure!(
                self.objectives.iter().all(|o| o.0 != p),
                "--objectives {objectives:?}: priority {p} is listed twice"
            );
            self.objectives.push((p, ms));
        }
        Ok(self)
    }

    /// The TTFT objective requests of band `priority` send, if any.
    pub fn objective_of(&self, priority: i64) -> Option<f64> {
        self.objectives.iter().find(|o| o.0 == priority).map(|o| o.1)
    }

    /// Request `i`'s `(priority, tenant)`.
    pub fn of(&self, req: &SimRequest, i: usize, seed: u64) -> (i64, u32) {
        let family = req.segments.first().map_or(i as u64, |s| s.seed);
        let tenant = pick(&self.tenants, unit(family ^ 0x7e4a_4e47));
        let shares: Vec<f64> = self.bands.iter().map(|b| b.1).collect();
        let band = pick(&shares, unit(seed ^ (i as u64).wrapping_mul(0x9e37_79b9)));
        (self.bands[band].0, tenant as u32)
    }
}

fn unit(x: u64) -> f64 {
    let mut rng = Rng::new(x);
    rng.below(1 << 30) as f64 / (1u64 << 30) as f64
}

fn pick(shares: &[f64], u: f64) -> usize {
    let mut acc = 0.0;
    for (k, s) in shares.iter().enumerate() {
        acc += s;
        if u < acc {
            return k;
        }
    }
    shares.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Segment;

    fn req(family: u64) -> SimRequest {
        SimRequest {
            arrival_ms: 0.0,
            segments: vec![Segment::new(family, 64), Segment::new(family * 1000 + 7, 16)],
            output_tokens: 8,
        }
    }

    #[test]
    fn a_prefix_family_has_one_tenant_and_shares_come_out_as_asked() {
        let c = Classes::parse("0.7,0.3", "1:0.2,0:0.8").unwrap();
        let mut heavy = 0;
        let mut high = 0;
        for f in 0..2000u64 {
            let (p1, t1) = c.of(&req(f), f as usize, 3);
            let (_, t2) = c.of(&req(f), f as usize + 5000, 3);
            assert_eq!(t1, t2, "family {f}");
            heavy += usize::from(t1 == 0);
            high += usize::from(p1 == 1);
        }
        assert!((1300..1500).contains(&heavy), "{heavy}");
        assert!((330..470).contains(&high), "{high}");
        assert!(Classes::parse("a", "0:1").is_err());
        assert!(Classes::parse("1", "0").is_err());
    }

    #[test]
    fn each_band_sends_its_own_objective() {
        let c = Classes::parse("1", "1:0.2,0:0.8")
            .unwrap()
            .with_objectives("1:2000, 0:10000")
            .unwrap();
        assert_eq!(c.objective_of(1), Some(2000.0));
        assert_eq!(c.objective_of(0), Some(10000.0));
        assert_eq!(c.objective_of(-1), None, "not listed: no header");
        for bad in ["1:0", "1", "x:100", "1:100,1:200", "1:inf"] {
            assert!(
                Classes::parse("1", "0:1").unwrap().with_objectives(bad).is_err(),
                "{bad}"
            );
        }
    }
}
