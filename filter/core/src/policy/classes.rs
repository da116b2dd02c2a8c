//! Learned prefill rates in classes of like servers.
//!
//! Sorted, rates that chain within `speed::SAME_WITHIN` of their neighbours form one class,
//! and a server is scored at its class's (upper) median rate (`policy::server_rate`). Like
//! servers' rates drift apart by noise, and scored each at its own they drew more or less
//! than their share: on 8 identical H100s (Azure trace, 110% load) some server's rate was
//! beyond 1.5× of the fleet's median in 30% of scrapes, while a gap of more than 1.5× between
//! neighbouring rates appeared in 3%; an H100's and an A100's rates on the mixed fleet were
//! further apart than that in 99.6%. The fleet's median, on 4 H100s and 4 A100s, is its
//! slowest H100; the class's median is a typical one. Chaining is transitive: a server
//! halfway between two GPU types joins them into one class.

use crate::speed::SAME_WITHIN;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct RateClasses {
    /// The learned rates, sorted, each with its class's rate.
    rates: Vec<(f64, f64)>,
    /// The class rate of the (upper) median rate.
    typical: Option<f64>,
}

impl RateClasses {
    /// The classes of `rates`; rates that are not finite and positive are left out.
    pub fn new(mut rates: Vec<f64>) -> RateClasses {
        rates.retain(|r| r.is_finite() && *r > 0.0);
        rates.sort_by(f64::total_cmp);
        let mut classed = Vec::with_capacity(rates.len());
        let mut start = 0;
        for end in 1..=rates.len() {
            if end == rates.len() || rates[end] / rates[end - 1] > SAME_WITHIN {
                let median = rates[start + (end - start) / 2];
                classed.extend(rates[start..end].iter().map(|r| (*r, median)));
                start = end;
            }
        }
        let typical = classed.get(classed.len() / 2).map(|(_, class)| *class);
        RateClasses {
            rates: classed,
            typical,
        }
    }

    /// The typical rate: the class rate of the fleet's (upper) median rate.
    pub fn typical(&self) -> Option<f64> {
        self.typical
    }

    /// The fastest class's rate.
    pub fn fastest(&self) -> Option<f64> {
        self.rates.last().map(|(_, class)| *class)
    }

    /// The class rate of `rate`, one of the learned rates the classes were built from (a
    /// rate that is none of them is its own class).
    pub fn class_of(&self, rate: f64) -> f64 {
        let at = self.rates.partition_point(|(r, _)| *r < rate);
        match self.rates.get(at) {
            Some((r, class)) if *r == rate => *class,
            _ => rate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gpu_type_is_one_class_at_its_median() {
        // Four H100s whose rates drifted apart (the outer two 1.7x apart, each within 1.5x
        // of its neighbour) and four A100s, 3x slower.
        let rates = [
            30_000.0, 38_000.0, 44_000.0, 51_000.0, 10_000.0, 11_500.0, 12_000.0, 14_000.0,
        ];
        let classes = RateClasses::new(rates.to_vec());
        let h100: Vec<f64> = rates[..4].iter().map(|r| classes.class_of(*r)).collect();
        let a100: Vec<f64> = rates[4..].iter().map(|r| classes.class_of(*r)).collect();
        assert_eq!(h100, [44_000.0; 4], "the H100s' upper median");
        assert_eq!(a100, [12_000.0; 4], "the A100s' upper median");
        assert_eq!(classes.typical(), Some(44_000.0), "the class of the fleet's median");
        assert_eq!(classes.class_of(20_000.0), 20_000.0, "a rate not learned is itself");
    }

    #[test]
    fn no_usable_rate_means_no_typical_rate() {
        assert_eq!(RateClasses::new(Vec::new()).typical(), None);
        assert_eq!(
            RateClasses::new(vec![f64::NAN, 0.0, -1.0, f64::INFINITY]).typical(),
            None
        );
        assert_eq!(RateClasses::new(vec![f64::NAN, 9_000.0]).typical(), Some(9_000.0));
    }
}
