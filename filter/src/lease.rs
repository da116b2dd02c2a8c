//! Who polls Envoy and scrapes the servers for this process: one `Poller`, never more.
//!
//! With the singleton service (`envoy.bootstrap.wasm`) the service always holds the lease.
//! Without one (on Istio, where kvroute comes as an HTTP filter), the worker VMs elect one
//! of themselves through a lease in shared data: the holder renews it every quarter of
//! `discovery.lease_ms`; the others check as often and take it, by compare-and-swap, once it
//! has not been renewed for `discovery.lease_ms` (the holder's VM crashed, or its thread
//! stopped ticking). Takeover therefore takes `lease_ms` to `1.25 × lease_ms`, during which
//! the workers route on the last published state. A service that starts after a worker
//! took the lease takes it over at once; the worker sees that at its next renewal.
//!
//! The record: holder (u64, unique per VM from a shared counter), renewed at (ms, u64),
//! and whether the holder is the service (one byte).

use kvroute_core::Millis;
use proxy_wasm::types::Status;

use crate::host;
use crate::mesh::increment;

const LEASE_KEY: &str = "kvroute.lease";
/// Test builds only: set by a request, makes the lease holder panic at its next tick.
#[cfg(feature = "test-panic")]
pub const TEST_PANIC_KEY: &str = "kvroute.test.panic_lease_holder";
const IDS_KEY: &str = "kvroute.lease.ids";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    holder: u64,
    renewed_at: Millis,
    service: bool,
}

impl Record {
    fn encode(self) -> [u8; 17] {
        let mut out = [0u8; 17];
        out[..8].copy_from_slice(&self.holder.to_le_bytes());
        out[8..16].copy_from_slice(&self.renewed_at.0.to_le_bytes());
        out[16] = u8::from(self.service);
        out
    }

    fn decode(bytes: &[u8]) -> Option<Record> {
        let holder = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let renewed_at = Millis(u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?));
        Some(Record {
            holder,
            renewed_at,
            service: *bytes.get(16)? == 1,
        })
    }
}

pub struct Lease {
    me: u64,
    service: bool,
    held: bool,
    checked_at: Option<Millis>,
    lease_ms: u64,
}

impl Lease {
    /// `None` when this VM cannot get an id (shared data unusable).
    pub fn new(service: bool, lease_ms: u64) -> Option<Lease> {
        Some(Lease {
            me: increment(IDS_KEY)?,
            service,
            held: false,
            checked_at: None,
            lease_ms,
        })
    }

    pub fn held(&self) -> bool {
        self.held
    }

    /// Renews, takes or gives up the lease as due; returns whether this VM holds it now.
    pub fn on_tick(&mut self, now: Millis) -> bool {
        let every = (self.lease_ms / 4).max(1);
        if self.checked_at.is_some_and(|t| now.since(t) < every) {
            return self.held;
        }
        self.checked_at = Some(now);
        self.held = self.try_hold(now);
        #[cfg(feature = "test-panic")]
        #[allow(clippy::panic)]
        if self.held && matches!(host::shared_data(TEST_PANIC_KEY), Ok(Some(v)) if v == b"1") {
            let _ = host::set_shared_data(TEST_PANIC_KEY, b"0");
            panic!("x-kvroute-test-panic: the lease holder");
        }
        self.held
    }

    fn try_hold(&self, now: Millis) -> bool {
        let mine = Record {
            holder: self.me,
            renewed_at: now,
            service: self.service,
        };
        for _ in 0..8 {
            let Ok((value, cas)) = host::shared_data_cas(LEASE_KEY) else {
                return false;
            };
            let current = value.as_deref().and_then(Record::decode);
            let take = match current {
                None => true,
                Some(r) if r.holder == self.me => true,
                // The service outranks workers; a worker waits for a silent holder.
                Some(r) => (self.service && !r.service) || now.since(r.renewed_at) > self.lease_ms,
            };
            if !take {
                return false;
            }
            match host::set_shared_data_cas(LEASE_KEY, &mine.encode(), cas) {
                Ok(()) => return true,
                Err(Status::CasMismatch) => continue,
                Err(_) => return false,
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_round_trips_and_short_bytes_are_refused() {
        let r = Record {
            holder: 7,
            renewed_at: Millis(123_456),
            service: true,
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(&r.encode()[..16]), None);
    }
}
