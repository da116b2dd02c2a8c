//! Gauges summed over the worker VMs of one Envoy process (`index_entries`,
//! `inflight_requests`, `hold.waiting`).
//!
//! Envoy merges a stat defined under one name by every VM, so a gauge is one value for the
//! process. Each VM used to move it by its own change since its last report: the sum was
//! right while every VM lived, but a VM that stopped (crashed under `FAIL_OPEN`, or replaced
//! by a configuration update) left its last share in the gauge for good. Now each worker
//! root writes its values with the time into one shared table, and sets each gauge to the
//! sum of the rows written lately (`stale_ms`): a VM that stops reporting drops out within
//! that and one report interval.
//!
//! The table lives in the shared data of one `vm_id`, the gauges in the whole process: two
//! kvroute plugins with different `vm_id`s in one Envoy would each set the gauges to their
//! own sums. The shipped configurations use one `vm_id`.

use kvroute_core::Millis;
use proxy_wasm::types::Status;

use crate::mesh::{self, SharedCells};

/// The gauges summed, in this order.
pub const GAUGES: usize = 3;

/// The shared table of rows, and the counter that names each VM's row.
const TABLE_KEY: &str = "kvroute.vm_gauges";
const IDS_KEY: &str = "kvroute.vm_gauges.ids";
/// A row older than this is not counted, or four ticks where the tick is slower (the
/// workers report every 100 ms, or at each tick when it is slower).
pub const STALE_MS: u64 = 2_000;
/// A row older than this many `stale_ms` leaves the table (a VM that reports again
/// replaces its own row whatever its age).
const FORGET_STALE: u64 = 2;
/// The most rows the table keeps (the newest win): far more VMs than one Envoy runs.
const MAX_ROWS: usize = 1_024;
const CAS_TRIES: usize = 8;
const ROW_BYTES: usize = 16 + 8 * GAUGES;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Row {
    vm: u64,
    at_ms: u64,
    values: [u64; GAUGES],
}

/// One VM's part in the table.
#[derive(Debug)]
pub struct VmGauges {
    /// This VM's row; `None` when shared data gave no name (the gauges are then not set).
    vm: Option<u64>,
    stale_ms: u64,
}

impl VmGauges {
    /// For a worker that ticks every `tick_ms`.
    pub fn join(tick_ms: u64) -> VmGauges {
        VmGauges {
            vm: mesh::increment(IDS_KEY),
            stale_ms: STALE_MS.max(tick_ms.saturating_mul(4)),
        }
    }

    /// Writes this VM's values and returns the sums over the rows still reporting, or
    /// `None` when shared data refused (the gauges then keep their last values).
    pub fn report(&self, values: [u64; GAUGES], now: Millis) -> Option<[u64; GAUGES]> {
        report_in(&mut mesh::HostShared, self.vm?, values, now, self.stale_ms)
    }
}

fn report_in(
    cells: &mut impl SharedCells,
    vm: u64,
    values: [u64; GAUGES],
    now: Millis,
    stale_ms: u64,
) -> Option<[u64; GAUGES]> {
    for _ in 0..CAS_TRIES {
        let (bytes, cas) = cells.get(TABLE_KEY).ok()?;
        let mut rows = decode(bytes.as_deref().unwrap_or_default());
        rows.retain(|r| r.vm != vm && now.0.saturating_sub(r.at_ms) <= stale_ms.saturating_mul(FORGET_STALE));
        rows.push(Row {
            vm,
            at_ms: now.0,
            values,
        });
        if rows.len() > MAX_ROWS {
            rows.sort_by_key(|r| std::cmp::Reverse(r.at_ms));
            rows.truncate(MAX_ROWS);
        }
        // An absent table is created only if it is still absent (`None`).
        match cells.set(TABLE_KEY, &encode(&rows), cas) {
            Ok(()) => return Some(sums(&rows, now, stale_ms)),
            Err(Status::CasMismatch) => continue,
            Err(_) => return None,
        }
    }
    None
}

fn sums(rows: &[Row], now: Millis, stale_ms: u64) -> [u64; GAUGES] {
    let mut sums = [0u64; GAUGES];
    for r in rows.iter().filter(|r| now.0.saturating_sub(r.at_ms) <= stale_ms) {
        for (s, v) in sums.iter_mut().zip(r.values) {
            *s = s.saturating_add(v);
        }
    }
    sums
}

fn encode(rows: &[Row]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * ROW_BYTES);
    for r in rows {
        out.extend_from_slice(&r.vm.to_le_bytes());
        out.extend_from_slice(&r.at_ms.to_le_bytes());
        for v in r.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// The rows of a table; a torn or foreign value reads as the whole rows it holds.
fn decode(bytes: &[u8]) -> Vec<Row> {
    let word = |c: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&c[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    bytes
        .chunks_exact(ROW_BYTES)
        .map(|c| Row {
            vm: word(c, 0),
            at_ms: word(c, 1),
            values: std::array::from_fn(|i| word(c, 2 + i)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::EnvoyCells as Cells;

    #[test]
    fn a_vm_that_stops_reporting_leaves_the_sums() {
        let mut cells = Cells::default();
        assert_eq!(
            report_in(&mut cells, 1, [10, 3, 0], Millis(1_000), STALE_MS),
            Some([10, 3, 0])
        );
        assert_eq!(
            report_in(&mut cells, 2, [12, 4, 1], Millis(1_050), STALE_MS),
            Some([22, 7, 1])
        );
        // VM 2 stops (a crash): its last values count while they are recent, then not.
        assert_eq!(
            report_in(&mut cells, 1, [11, 2, 0], Millis(1_100), STALE_MS),
            Some([23, 6, 1])
        );
        assert_eq!(
            report_in(&mut cells, 1, [11, 0, 0], Millis(1_050 + STALE_MS + 1), STALE_MS),
            Some([11, 0, 0]),
            "the stopped VM's in-flight requests and held ones are gone from the gauges"
        );
        // A VM that reports again is counted again, once.
        assert_eq!(
            report_in(&mut cells, 2, [5, 1, 0], Millis(3_200), STALE_MS),
            Some([16, 1, 0])
        );
        assert_eq!(
            report_in(&mut cells, 2, [5, 1, 0], Millis(3_300), STALE_MS),
            Some([16, 1, 0])
        );
    }

    #[test]
    fn a_write_that_lost_a_race_is_made_again_on_the_winners_table() {
        let mut cells = Cells::default();
        report_in(&mut cells, 1, [1, 1, 1], Millis(10), STALE_MS).unwrap();
        // VM 3 writes its row right after VM 2 read the table: VM 2's write is refused, and
        // it writes again on top of VM 3's row, which it keeps.
        cells.other_vm = Some(Box::new(|c: &mut Cells| {
            assert_eq!(report_in(c, 3, [4, 4, 4], Millis(20), STALE_MS), Some([5, 5, 5]));
        }));
        assert_eq!(
            report_in(&mut cells, 2, [2, 2, 2], Millis(30), STALE_MS),
            Some([7, 7, 7])
        );
        assert!(cells.other_vm.is_none(), "VM 3 wrote in between");
    }

    #[test]
    fn garbage_in_the_table_is_read_as_the_whole_rows_it_holds() {
        let mut cells = Cells::default();
        cells.set(TABLE_KEY, b"not a table", None).unwrap();
        assert_eq!(
            report_in(&mut cells, 1, [1, 2, 3], Millis(5), STALE_MS),
            Some([1, 2, 3])
        );
        let rows = decode(&encode(&[Row {
            vm: 7,
            at_ms: 9,
            values: [1, 2, 3],
        }]));
        assert_eq!(rows.len(), 1);
        assert_eq!(decode(&[0u8; ROW_BYTES + 5]).len(), 1);
    }

    #[test]
    fn rows_long_gone_leave_the_table() {
        let mut cells = Cells::default();
        for vm in 1..=5 {
            report_in(&mut cells, vm, [1, 0, 0], Millis(100), STALE_MS).unwrap();
        }
        report_in(
            &mut cells,
            9,
            [1, 0, 0],
            Millis(100 + STALE_MS * FORGET_STALE + 1),
            STALE_MS,
        )
        .unwrap();
        let (bytes, _) = cells.get(TABLE_KEY).unwrap();
        assert_eq!(decode(&bytes.unwrap()).len(), 1);
    }
}
