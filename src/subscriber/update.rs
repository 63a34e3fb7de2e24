//! What the loop's steps pass between them: the options of a step, where
//! a bucket's versions come from ([`Log`]), and an [`Update`] (the way from
//! what a sink holds to a version, with the manifests it needs and whatever
//! was read while planning).

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::protocol::Manifest;
use crate::tensors::TensorSet;

use super::plan::Plan;

/// Where a bucket's versions come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Log {
    /// weightcast's commit log: `versions/`, manifests, `latest.json`.
    #[default]
    Weightcast,
    /// TRL's own layout: `anchors/step_N.safetensors` and
    /// `deltas/step_N.safetensors`, no manifests ([`super::trl`]).
    Trl,
}

/// How [`Subscriber::next_update`](super::step::Subscriber::next_update) chooses.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepOptions {
    /// List the bucket even if the `latest.json` hint did not move (after a
    /// notification, at start).
    pub thorough: bool,
    /// Start from an anchor even when a replay is possible (the caller
    /// distrusts what the sink holds).
    pub anchor: bool,
}

/// An update the loop chose: from `base` (`None`: from an anchor) to
/// `version`, with the manifests it needs. Nothing is downloaded yet.
#[derive(Debug)]
pub struct Update {
    /// The version the update reaches.
    pub version: u64,
    /// The version planned for: [`Update::version`], or newer when a sink
    /// that takes one version at a time got the first version of a replay
    /// (a repair aims here, from this version's anchor).
    pub target: u64,
    /// The version it applies to (`None`: it starts from an anchor).
    pub base: Option<u64>,
    /// The way there.
    pub plan: Plan,
    /// The manifests of the versions it feeds (synthesized from the keys
    /// for a TRL bucket).
    pub(crate) chain: BTreeMap<u64, Manifest>,
    /// Objects read while planning, by key (a TRL bucket's: there is no
    /// manifest to check them against later).
    pub(crate) ready: BTreeMap<String, Ready>,
    /// Some object carried no weightcast digests (TRL's own): checked
    /// structurally only.
    pub(crate) structural_only: bool,
}

/// An object read while planning.
#[derive(Debug)]
pub(crate) enum Ready {
    /// Its bytes.
    Bytes(Bytes),
    /// An anchor, decoded and checked.
    Tensors(TensorSet),
}

impl Update {
    /// Whether it starts from an anchor.
    pub fn from_anchor(&self) -> bool {
        matches!(self.plan, Plan::Bootstrap { .. })
    }

    /// The manifest of `version`, one of the versions the update feeds.
    pub fn manifest(&self, version: u64) -> Option<&Manifest> {
        self.chain.get(&version)
    }

    /// The versions fed to the sink, in order (an anchor's first).
    pub fn versions(&self) -> Vec<u64> {
        self.plan.versions()
    }

    /// Bytes of objects the update downloads.
    pub fn download_bytes(&self) -> u64 {
        match &self.plan {
            Plan::UpToDate => 0,
            Plan::Replay(vs) => vs.iter().map(|v| self.chain[v].replay_bytes()).sum(),
            Plan::Bootstrap { anchor, replay } => {
                self.chain[anchor].bootstrap_bytes()
                    + replay
                        .iter()
                        .map(|v| self.chain[v].replay_bytes())
                        .sum::<u64>()
            }
        }
    }
}
