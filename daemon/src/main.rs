//! kvtierd
fn main() {}
