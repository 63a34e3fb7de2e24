//! Reading a trace of `scripts/make_traces.py`: the full bf16 weights of step
//! 0, then each step's changes (zstd of safetensors: per parameter `.gap`,
//! U32 gaps between changed flat indices, and `.val`, U16 new bf16 words).

use std::path::{Path, PathBuf};

use weightcast_core::dtype::Dtype;
use weightcast_core::tensors::TensorSet;

/// A trace walked forward one step at a time.
pub struct Trace {
    dir: PathBuf,
    /// (name, shape, bf16 bytes), sorted by name.
    params: Vec<(String, Vec<usize>, Vec<u8>)>,
    /// The step the parameters hold.
    pub step: usize,
}

impl Trace {
    /// The trace in `dir` at step 0.
    pub fn open(dir: &Path) -> Trace {
        let bytes = std::fs::read(dir.join("step_00000.safetensors")).expect("step 0");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let mut params: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Trace {
            dir: dir.to_path_buf(),
            params,
            step: 0,
        }
    }

    /// Whether step `step + 1` exists.
    #[allow(dead_code)] // not every example that includes this walks to the end
    pub fn has_next(&self) -> bool {
        self.dir
            .join(format!("step_{:05}.delta.zst", self.step + 1))
            .exists()
    }

    /// Moves to the next step.
    pub fn advance(&mut self) {
        let t = self.step + 1;
        let z = std::fs::read(self.dir.join(format!("step_{t:05}.delta.zst"))).expect("step");
        let blob = zstd::decode_all(&z[..]).expect("zstd");
        if !blob.is_empty() {
            let st = safetensors::SafeTensors::deserialize(&blob).expect("step");
            for (name, _, data) in &mut self.params {
                let Ok(g) = st.tensor(&format!("{name}.gap")) else {
                    continue;
                };
                let v = st.tensor(&format!("{name}.val")).expect("values");
                let mut at = 0usize;
                for (j, (gc, vc)) in g
                    .data()
                    .chunks_exact(4)
                    .zip(v.data().chunks_exact(2))
                    .enumerate()
                {
                    at += u32::from_le_bytes(gc.try_into().unwrap()) as usize + usize::from(j > 0);
                    data[2 * at..2 * at + 2].copy_from_slice(vc);
                }
            }
        }
        self.step = t;
    }

    /// The weights of the current step, without digests.
    pub fn set(&self) -> TensorSet {
        TensorSet::from_tensors(
            self.params
                .iter()
                .map(|(n, s, d)| (n.clone(), Dtype::BF16, s.clone(), d.clone())),
        )
        .expect("tensor set")
    }
}
