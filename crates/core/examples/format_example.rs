//! Prints the worked example of docs/format.md: a two-tensor model, one step,
//! the compact delta's header and payload bytes.
//!
//! `cargo run --example format_example`

use weightcast_core::codec::{DeltaOptions, encode_delta, inspect};
use weightcast_core::dtype::Dtype;
use weightcast_core::format::Encoding;
use weightcast_core::tensors::TensorSet;

fn bf16s(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let w0 = [0.5f32, -0.25, 0.125, 1.0, -1.0, 0.0, 2.0, 3.0];
    let base = TensorSet::from_tensors(vec![
        ("w".to_string(), Dtype::BF16, vec![2, 4], bf16s(&w0)),
        (
            "n".to_string(),
            Dtype::F32,
            vec![2],
            vec![0, 0, 128, 63, 0, 0, 0, 64],
        ),
    ])?;
    // Element 1 moves up one bf16 ulp (toward +inf: -0.25 → -0.2490234375),
    // element 6 down one ulp (2.0 → 1.9921875).
    let mut w1 = bf16s(&w0);
    let e1 = u16::from_le_bytes([w1[2], w1[3]]) - 1; // negative: smaller magnitude
    w1[2..4].copy_from_slice(&e1.to_le_bytes());
    let e6 = u16::from_le_bytes([w1[12], w1[13]]) - 1;
    w1[12..14].copy_from_slice(&e6.to_le_bytes());
    let mut new = TensorSet::from_tensors_unhashed(vec![
        ("w".to_string(), Dtype::BF16, vec![2, 4], w1),
        (
            "n".to_string(),
            Dtype::F32,
            vec![2],
            vec![0, 0, 128, 63, 0, 0, 0, 64],
        ),
    ])?;
    let opts = DeltaOptions {
        encoding: Encoding::Compact,
        model_version: 8,
        base_version: 7,
        ..Default::default()
    };
    let (bytes, _) = encode_delta(&base, &mut new, &opts)?;
    let (meta, _) = inspect(&bytes)?;
    let n = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    println!("total bytes: {}", bytes.len());
    println!("header length (u64 LE): {n}");
    println!(
        "header: {}",
        std::str::from_utf8(&bytes[8..8 + n])?.trim_end()
    );
    println!("metadata:");
    for (k, v) in &meta {
        println!("  {k} = {v}");
    }
    print!("data section:");
    for b in &bytes[8 + n..] {
        print!(" {b:08b}");
    }
    println!();
    Ok(())
}
