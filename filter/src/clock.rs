//! The filter's clock: Envoy's wall clock with its steps back absorbed, one clock for the
//! whole process.
//!
//! Proxy-wasm ABI 0.2.1 gives only the wall clock, and the filter measures every interval
//! on it (scrapes, discovery, heartbeats, holding's wait bound): a step back (NTP at boot, a
//! migrated VM) would stop them all until the wall clock caught up. From a step back on,
//! time goes on from where it was, at the wall clock's pace: an offset that stays. Times
//! cross VMs (the lease, the fleet state's scrape times, the hold board), so the offset is
//! the process's: a VM that sees a step raises the shared one (`OFFSET_KEY`, compare and
//! swap), and every VM adopts the largest, when it starts and then every `SYNC_MS`. A step
//! forward cannot be told from a pause and is taken as it comes (peers may look gone and
//! held requests time out: both release).

use std::cell::Cell;

use kvroute_core::Millis;
use proxy_wasm::types::Status;

use crate::host;

const OFFSET_KEY: &str = "kvroute.clock.offset_ms";
/// How often a VM reads the process's offset (ms of its own time).
const SYNC_MS: u64 = 100;

thread_local! {
    static CLOCK: Cell<Monotonic> = const { Cell::new(Monotonic { last: 0, offset: 0, synced_at: None }) };
}

/// The time now (ms).
pub fn now() -> Millis {
    CLOCK.with(|c| {
        let mut clock = c.get();
        // A failed read is no step back: the time stays where it was.
        let Some(wall) = host::wall_ms() else {
            return Millis(clock.last);
        };
        let before = clock.offset;
        let mut t = clock.at(wall);
        if clock.offset > before {
            raise_shared_offset(clock.offset);
        } else if clock.synced_at.is_none_or(|at| t.saturating_sub(at) >= SYNC_MS) {
            clock.synced_at = Some(t);
            if let Some(shared) = host::shared_data_cas(OFFSET_KEY)
                .ok()
                .and_then(|(v, _)| v)
                .and_then(decode)
            {
                t = clock.adopt(wall, shared);
            }
        }
        c.set(clock);
        Millis(t)
    })
}

fn decode(bytes: Vec<u8>) -> Option<u64> {
    bytes.try_into().ok().map(u64::from_le_bytes)
}

/// Makes the process's offset at least `offset` (a few tries: VMs that saw the same step
/// race here, and their offsets differ by the milliseconds between their reads).
fn raise_shared_offset(offset: u64) {
    for _ in 0..8 {
        let Ok((value, cas)) = host::shared_data_cas(OFFSET_KEY) else {
            return;
        };
        if value.and_then(decode).is_some_and(|shared| shared >= offset) {
            return;
        }
        match host::set_shared_data_cas(OFFSET_KEY, &offset.to_le_bytes(), cas) {
            Err(Status::CasMismatch) => continue,
            _ => return,
        }
    }
}

/// One VM's clock: the last time it returned and the offset it adds to the wall clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Monotonic {
    last: u64,
    offset: u64,
    /// When (its own time) it last read the process's offset.
    synced_at: Option<u64>,
}

impl Monotonic {
    /// The time at wall clock `wall` (ms), never before the last one returned.
    pub fn at(&mut self, wall: u64) -> u64 {
        let t = wall.saturating_add(self.offset);
        if t < self.last {
            self.offset += self.last - t;
            return self.last;
        }
        self.last = t;
        t
    }

    /// Takes the process's `offset` when it is larger (another VM saw a step back this one
    /// did not, or saw it first), then the time at `wall`.
    pub fn adopt(&mut self, wall: u64, offset: u64) -> u64 {
        self.offset = self.offset.max(offset);
        self.at(wall)
    }
}

#[cfg(test)]
mod tests {
    use super::Monotonic;

    const HOUR: u64 = 3_600_000;

    #[test]
    fn a_step_back_of_the_wall_clock_neither_stops_nor_reverses_time() {
        let mut clock = Monotonic::default();
        assert_eq!(clock.at(HOUR + 10_000), HOUR + 10_000);
        assert_eq!(clock.at(HOUR + 10_050), HOUR + 10_050);
        // The wall clock steps back an hour: time stays, then goes on at the wall's pace.
        assert_eq!(clock.at(10_060), HOUR + 10_050);
        assert_eq!(clock.at(10_160), HOUR + 10_150);
        assert_eq!(clock.at(10_200), HOUR + 10_190);
        // A step forward is taken as it comes.
        assert_eq!(clock.at(20_000), HOUR + 19_990);
    }

    #[test]
    fn a_vm_that_starts_after_a_step_back_keeps_the_time_of_the_others() {
        let mut old = Monotonic::default();
        old.at(HOUR + 10_000);
        let seen = old.at(10_010);
        let mut new = Monotonic::default();
        // The new VM never saw the step: the process's offset puts it on the old one's time.
        assert_eq!(new.adopt(10_010, old.offset), seen);
        assert_eq!(new.at(10_110), old.at(10_110));
        // A smaller offset than its own changes nothing.
        assert_eq!(old.adopt(10_120, 0), HOUR + 10_110);
    }
}
