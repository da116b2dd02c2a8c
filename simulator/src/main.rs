//! `kvroute-sim`: replay | serve | bench.
fn main() {}
