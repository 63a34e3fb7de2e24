//! CPU dispatch in one place, in the manner of BLAKE3's `platform.rs`: which
//! instruction sets the hot loops may use on this machine, detected once.
//!
//! The codec's and the digest's inner loops are plain, safe Rust. On x86-64
//! some of them also exist in a second form: the same code compiled with AVX2,
//! BMI1/2, LZCNT and POPCNT enabled (the scan, the encoder, the apply, the
//! baseline compare), or hand-written AVX-512 kernels (digest sums and full
//! passes; the fused `compact` encoder and the apply's group kernel). Which
//! form runs is decided by a [`Platform`]: [`Platform::detect`] reads the CPU
//! once (cached) and honours `WEIGHTCAST_SIMD=off`, which turns every
//! SIMD form off so that the portable code runs everywhere (the test script
//! runs the round-trip suites that way; an operator can rule the vector paths
//! out when diagnosing), and `WEIGHTCAST_SIMD=avx2` or `avx512`, which cap
//! the level (an AVX-512 host measures what a host without it runs).
//!
//! Levels are ordered ([`Level`]); each includes the ones below it. A
//! `Platform` can only be made by detection (its field is private), and
//! [`Platform::capped`] only lowers it, so `platform.has(level)` is proof
//! that the CPU has every feature of `level`. Each `#[target_feature]`
//! function is private to the module that implements it and is called only
//! from a safe wrapper in that module that checks `has` first; that check is
//! the whole proof obligation of the wrapper's `unsafe` call (executing an
//! instruction the CPU lacks is the only undefined behaviour at stake).
//! [`HasAvx512`] carries the same proof into kernels that share the digest's
//! eight-lane helpers.

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set level the crate has code for. Ordered: each level
/// includes every feature of the levels below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable Rust only.
    Portable,
    /// x86-64 with AVX2, BMI1, BMI2, LZCNT and POPCNT: the scan, encoder,
    /// apply and baseline compare compiled for them.
    Avx2,
    /// Plus AVX-512 F and DQ: digest sums and full digest passes eight lanes
    /// at a time.
    Avx512,
    /// Plus AVX-512 BW, CD and VBMI2: the fused `compact` encoder for 2-byte
    /// words and the apply's group kernel.
    Avx512Vbmi2,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 4] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Vbmi2,
    ];

    /// How people call this level ("AVX2", "AVX-512", …).
    pub fn describe(self) -> &'static str {
        match self {
            Level::Portable => "portable code",
            Level::Avx2 => "AVX2",
            Level::Avx512 => "AVX-512",
            Level::Avx512Vbmi2 => "AVX-512 VBMI2",
        }
    }

    /// The CPU features (as `is_x86_feature_detected!` names them) this level
    /// needs, its own and those of the levels below it.
    pub fn features(self) -> Vec<&'static str> {
        FEATURES
            .iter()
            .filter(|f| f.level <= self)
            .map(|f| f.name)
            .collect()
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// One CPU feature, the level that first needs it and its run-time check.
struct Feature {
    level: Level,
    name: &'static str,
    present: fn() -> bool,
}

macro_rules! features {
    ($($level:ident $name:tt),* $(,)?) => {
        [$(Feature {
            level: Level::$level,
            name: $name,
            present: || {
                #[cfg(target_arch = "x86_64")]
                {
                    std::arch::is_x86_feature_detected!($name)
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    false
                }
            },
        }),*]
    };
}

/// Every feature the levels need. The `#[target_feature]` lists of the
/// kernels are subsets of their level's list here.
const FEATURES: [Feature; 10] = features![
    Avx2 "avx2",
    Avx2 "bmi1",
    Avx2 "bmi2",
    Avx2 "lzcnt",
    Avx2 "popcnt",
    Avx512 "avx512f",
    Avx512 "avx512dq",
    Avx512Vbmi2 "avx512bw",
    Avx512Vbmi2 "avx512cd",
    Avx512Vbmi2 "avx512vbmi2",
];

/// The features of `level` (and below) that this CPU does not have.
pub fn missing_features(level: Level) -> Vec<&'static str> {
    FEATURES
        .iter()
        .filter(|f| f.level <= level && !(f.present)())
        .map(|f| f.name)
        .collect()
}

/// The highest level whose every feature the CPU has.
fn cpu_level() -> Level {
    let mut best = Level::Portable;
    for level in Level::ALL {
        if missing_features(level).is_empty() {
            best = level;
        } else {
            break;
        }
    }
    best
}

/// The highest level the environment lets the hot loops use, read once per
/// process from `WEIGHTCAST_SIMD`: `off` (or `portable`) turns every SIMD
/// form off; `avx2` and `avx512` cap the level there, so that an AVX-512
/// host can measure or diagnose what a host without it runs; unset, `on` or
/// any other value leaves the CPU's own level.
pub fn simd_cap() -> Level {
    static CAP: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        cap_named(
            std::env::var_os("WEIGHTCAST_SIMD")
                .as_deref()
                .and_then(|v| v.to_str()),
        )
    })
}

/// The cap a `WEIGHTCAST_SIMD` value names (see [`simd_cap`]).
fn cap_named(value: Option<&str>) -> Level {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("off" | "portable") => Level::Portable,
        Some("avx2") => Level::Avx2,
        Some("avx512" | "avx-512") => Level::Avx512,
        _ => Level::Avx512Vbmi2,
    }
}

/// Whether the SIMD forms may run at all: `WEIGHTCAST_SIMD=off` in the
/// environment turns every one of them off. Read once per process.
pub fn simd_allowed() -> bool {
    simd_cap() > Level::Portable
}

/// A cached level: `u8::MAX` until detected.
struct Cached(AtomicU8);

impl Cached {
    const UNKNOWN: u8 = u8::MAX;

    fn get(&self, detect: impl FnOnce() -> Level) -> Level {
        match self.0.load(Ordering::Relaxed) {
            Self::UNKNOWN => {
                // Detection is idempotent: a race only detects twice.
                let l = detect();
                self.0.store(l as u8, Ordering::Relaxed);
                l
            }
            v => Level::ALL[v as usize],
        }
    }
}

static CPU: Cached = Cached(AtomicU8::new(Cached::UNKNOWN));
static ACTIVE: Cached = Cached(AtomicU8::new(Cached::UNKNOWN));

/// Which instruction sets the hot loops use: a [`Level`] the CPU is known to
/// have. Only detection makes one, so holding a `Platform` whose
/// [`has`](Platform::has) says yes is proof of the CPU's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Platform {
    level: Level,
}

impl Platform {
    /// The platform the crate runs on: the CPU's level (detected once),
    /// lowered to the cap `WEIGHTCAST_SIMD` names ([`simd_cap`]; portable
    /// code when it is `off`).
    #[inline]
    pub fn detect() -> Platform {
        let level = ACTIVE.get(|| Platform::cpu().level.min(simd_cap()));
        Platform { level }
    }

    /// What the CPU itself has, whatever `WEIGHTCAST_SIMD` says (tests that
    /// compare a SIMD form with the portable one use it).
    #[inline]
    pub fn cpu() -> Platform {
        Platform {
            level: CPU.get(cpu_level),
        }
    }

    /// Portable code only (always valid).
    pub const fn portable() -> Platform {
        Platform {
            level: Level::Portable,
        }
    }

    /// This platform's level.
    #[inline]
    pub fn level(self) -> Level {
        self.level
    }

    /// Whether code for `level` may run: the CPU has every feature of it.
    #[inline]
    pub fn has(self, level: Level) -> bool {
        self.level >= level
    }

    /// This platform limited to `max` (lower levels are subsets, so the
    /// proof carries over).
    pub fn capped(self, max: Level) -> Platform {
        Platform {
            level: self.level.min(max),
        }
    }

    /// The proof that AVX-512 F and DQ are present, for kernels that use the
    /// digest's eight-lane helpers.
    #[inline]
    pub fn avx512(self) -> Option<HasAvx512> {
        self.has(Level::Avx512).then_some(HasAvx512(()))
    }
}

/// Proof that the CPU has AVX-512 F and DQ ([`Level::Avx512`]); only
/// [`Platform::avx512`] makes one.
#[derive(Clone, Copy, Debug)]
pub struct HasAvx512(());

/// Hints the CPU to bring the cache line holding `data[at]` (element `at`,
/// of any type) into L1 soon (PREFETCHT0).
///
/// A hint only: it never faults, never changes memory, and does nothing when
/// `at` is out of range or on targets without a prefetch instruction.
#[inline(always)]
pub fn prefetch<T>(data: &[T], at: usize) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(data, at);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at);
}

/// Like [`prefetch`], but asks for the line in the second-level cache only
/// (PREFETCHT1). Such a request holds no first-level miss buffer while the
/// line comes from memory, so many more can be in flight: the apply
/// pipelines issue it hundreds of entries ahead. On the development machine
/// (Zen 4), `cargo run --release --example prefetch_probe -- 0.017` (a plain
/// read-modify-write of 1.7% of a 256 MB buffer's words, ascending) took
/// 9.96 ns per word with PREFETCHT0 32 words ahead and 6.82 ns with
/// PREFETCHT1 256 ahead.
#[inline(always)]
pub fn prefetch_l2(data: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_T1 }, u8>(data, at);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at);
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn hint<const H: i32, T>(data: &[T], at: usize) {
    if let Some(b) = data.get(at) {
        // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 CPU has (it is
        // in the target's baseline feature set), and the pointer comes from a
        // live reference. A prefetch is a hint: it reads nothing
        // architecturally and cannot fault. Exercised by every codec test
        // that applies a step-coded block (and `prefetch_is_only_a_hint`).
        unsafe { std::arch::x86_64::_mm_prefetch::<H>((b as *const T).cast()) };
    }
}

/// Which code path each dispatch point took, counted in test builds only, so
/// that tests can prove where `WEIGHTCAST_SIMD=off` and detection route.
#[cfg(test)]
pub(crate) mod trace {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::Level;

    /// The dispatch points.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Site {
        /// `codec::scan`: the 2-byte changed-word scan (AVX2 or portable).
        Scan,
        /// `codec::scan::count_changed_plain` (AVX2 or portable).
        Compare,
        /// The `compact` block encoder (AVX2 build or portable).
        Encode,
        /// The fused AVX-512 encoder for a block's direct part.
        EncodeFused,
        /// The `compact` block apply (AVX2 build or portable).
        Apply,
        /// The apply's group kernel (AVX-512 VBMI2 or scalar).
        Group,
        /// `TensorSeed::change_sum` (AVX-512 or scalar).
        ChangeSum,
        /// Full digest passes (AVX-512 or the table loop).
        FullPass,
    }

    impl Site {
        pub(crate) const ALL: [Site; 8] = [
            Site::Scan,
            Site::Compare,
            Site::Encode,
            Site::EncodeFused,
            Site::Apply,
            Site::Group,
            Site::ChangeSum,
            Site::FullPass,
        ];

        /// The level of the site's SIMD form (it runs that or portable code).
        pub(crate) fn simd(self) -> Level {
            match self {
                Site::Scan | Site::Compare | Site::Encode | Site::Apply => Level::Avx2,
                Site::ChangeSum | Site::FullPass => Level::Avx512,
                Site::EncodeFused | Site::Group => Level::Avx512Vbmi2,
            }
        }
    }

    static COUNTS: [[AtomicU64; 4]; 8] = [const { [const { AtomicU64::new(0) }; 4] }; 8];

    /// Records that `site` ran code of `level`.
    #[inline]
    pub(crate) fn took(site: Site, level: Level) {
        COUNTS[site as usize][level as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How often `site` ran code of `level` so far in this process.
    pub(crate) fn count(site: Site, level: Level) -> u64 {
        COUNTS[site as usize][level as usize].load(Ordering::Relaxed)
    }
}

/// Records a dispatch decision (test builds only; nothing otherwise).
macro_rules! dispatched {
    ($site:ident, $level:expr) => {
        #[cfg(test)]
        $crate::platform::trace::took($crate::platform::trace::Site::$site, $level);
    };
}
pub(crate) use dispatched;

/// `WEIGHTCAST_EXPECT_SIMD` for the SIMD agreement tests: which instruction
/// sets the machine running the tests must have.
#[cfg(test)]
pub(crate) mod expect {
    use super::{Level, Platform, missing_features};

    /// The expected level: `none` (or unset) → portable, `avx2`, `avx512`
    /// (every AVX-512 subset the crate uses).
    pub(crate) fn expected() -> Level {
        match std::env::var("WEIGHTCAST_EXPECT_SIMD").as_deref() {
            Err(_) | Ok("") | Ok("none") => Level::Portable,
            Ok("avx2") => Level::Avx2,
            Ok("avx512") => Level::Avx512Vbmi2,
            Ok(other) => panic!("WEIGHTCAST_EXPECT_SIMD={other}: expected none, avx2 or avx512"),
        }
    }

    /// The `WEIGHTCAST_EXPECT_SIMD` value that requires `level`.
    fn value_for(level: Level) -> &'static str {
        match level {
            Level::Portable => "none",
            Level::Avx2 => "avx2",
            Level::Avx512 | Level::Avx512Vbmi2 => "avx512",
        }
    }

    /// Whether a test that needs `level` runs its SIMD half here. Yes when
    /// the CPU has it (whatever `WEIGHTCAST_SIMD` says: the tests call the
    /// SIMD forms explicitly). When it lacks it, the test **fails** if
    /// `WEIGHTCAST_EXPECT_SIMD` expects that level (naming the missing
    /// features), and otherwise prints a `SKIPPED:` line to stderr (visible
    /// without `--nocapture`) and the caller returns.
    pub(crate) fn require(level: Level, test: &str) -> bool {
        if Platform::cpu().has(level) {
            return true;
        }
        let missing = missing_features(level);
        assert!(
            expected() < level,
            "{test}: WEIGHTCAST_EXPECT_SIMD={} expects {level}, but this CPU lacks {}",
            std::env::var("WEIGHTCAST_EXPECT_SIMD").unwrap_or_default(),
            missing.join(", ")
        );
        // Straight to the process's stderr: `eprintln!` would be captured by
        // the test harness and shown only for failing tests.
        let line = format!(
            "SKIPPED: {test}: this CPU has no {level} (set WEIGHTCAST_EXPECT_SIMD={} to require it)\n",
            value_for(level)
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        false
    }

    /// The platforms a test compares with the portable code: the CPU capped
    /// at each of `levels` (lowest first) that [`require`] lets run; stops at
    /// the first it skips.
    pub(crate) fn platforms(test: &str, levels: &[Level]) -> Vec<Platform> {
        let mut out = Vec::new();
        for &level in levels {
            if !require(level, &format!("{test} ({level})")) {
                break;
            }
            out.push(Platform::cpu().capped(level));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::trace::{Site, count};
    use super::*;

    #[test]
    fn prefetch_is_only_a_hint() {
        let data: Vec<u8> = (0..200u8).collect();
        for at in [0, 63, 64, 199, 200, usize::MAX] {
            prefetch(&data, at);
            prefetch_l2(&data, at);
        }
        prefetch::<u8>(&[], 0);
        prefetch(&[1u32, 2], 1);
        prefetch(&[1u32, 2], 2);
        prefetch_l2(&[], 0);
        assert!(data.iter().copied().eq(0..200u8));
    }

    #[test]
    fn levels_nest_and_detection_is_consistent() {
        let cpu = Platform::cpu();
        // Every level up to the CPU's has all its features, the next one not.
        for l in Level::ALL {
            assert_eq!(missing_features(l).is_empty(), cpu.has(l), "{l}");
            assert!(l.features().len() >= missing_features(l).len());
        }
        assert!(Level::Avx512Vbmi2.features().contains(&"avx2"));
        let active = Platform::detect();
        assert!(active.level() <= cpu.level());
        if simd_allowed() {
            assert_eq!(active, cpu);
        } else {
            assert_eq!(active, Platform::portable());
        }
        assert_eq!(
            cpu.capped(Level::Avx2).level(),
            cpu.level().min(Level::Avx2)
        );
        assert_eq!(cpu.avx512().is_some(), cpu.has(Level::Avx512));
        eprintln!("CPU level: {}; active: {}", cpu.level(), active.level());
    }

    /// `WEIGHTCAST_EXPECT_SIMD` is a promise about the machine: fail loudly
    /// when it does not hold.
    #[test]
    fn the_expected_instruction_sets_are_present() {
        let want = expect::expected();
        let missing = missing_features(want);
        assert!(
            missing.is_empty(),
            "WEIGHTCAST_EXPECT_SIMD expects {want}, but this CPU lacks {}",
            missing.join(", ")
        );
    }

    /// Runs each dispatch point on a workload that reaches it: a bf16 tensor
    /// longer than the encoder's sample (so the direct part runs), its
    /// `compact` and `trl` deltas applied, and a full digest pass.
    fn workload() {
        use crate::codec::{DeltaOptions, apply_delta, encode_delta};
        use crate::dtype::Dtype;
        use crate::format::Encoding;
        use crate::tensors::TensorSet;
        let words = 300_000usize;
        let base: Vec<u8> = (0..words)
            .flat_map(|i| (0x3c00 + (i as u16).wrapping_mul(7919) % 0x3000).to_le_bytes())
            .collect();
        let mut new = base.clone();
        for i in (0..words).step_by(53) {
            new[2 * i] ^= 1;
        }
        let item = |d: &[u8]| [("w".to_string(), Dtype::BF16, vec![words], d.to_vec())];
        let v0 = TensorSet::from_tensors(item(&base)).expect("base");
        for encoding in [Encoding::Compact, Encoding::Trl] {
            let mut v1 = TensorSet::from_tensors_unhashed(item(&new)).expect("new");
            let opts = DeltaOptions::new(encoding, 1, 0);
            let (delta, _) = encode_delta(&v0, &mut v1, &opts).expect("encode");
            let mut replica = v0.clone();
            apply_delta(&mut replica, &delta).expect("apply");
            assert!(replica.data(0) == v1.data(0));
        }
        crate::codec::scan::count_changed_plain(2, &base, &new);
        v0.full_digests();
    }

    /// Every dispatch point takes the path [`Platform::detect`] allows: its
    /// SIMD form where the platform has that level, portable code otherwise.
    /// Run in a process of its own with `WEIGHTCAST_SIMD=off` (below), no
    /// SIMD form may run at all.
    #[test]
    fn dispatch_follows_the_detected_platform() {
        let p = Platform::detect();
        let before: Vec<[u64; 4]> = Site::ALL
            .iter()
            .map(|&s| Level::ALL.map(|l| count(s, l)))
            .collect();
        workload();
        for (s, was) in Site::ALL.iter().zip(before) {
            let want = if p.has(s.simd()) {
                s.simd()
            } else {
                Level::Portable
            };
            assert!(
                count(*s, want) > was[want as usize],
                "{s:?} did not run its {want} form (the platform's level: {})",
                p.level()
            );
        }
        if let Some(cap) = std::env::var_os("WEIGHTCAST_DISPATCH_CHILD") {
            // Alone in this process: nothing else can have counted.
            let cap = cap_named(cap.to_str());
            assert_eq!(
                simd_cap(),
                cap,
                "the child runs with WEIGHTCAST_SIMD capped"
            );
            assert_eq!(p.level(), Platform::cpu().level().min(cap));
            for s in Site::ALL {
                for l in Level::ALL.iter().filter(|l| **l > cap) {
                    assert_eq!(count(s, *l), 0, "{s:?} ran {l} code above the cap {cap}");
                }
            }
            println!("dispatch child: every site ran code at or below {cap} only");
        }
    }

    /// Runs the test above alone in a child process with `WEIGHTCAST_SIMD`
    /// set to `value`: no dispatch point may run code above `cap`.
    fn child_with_cap(value: &str, cap: Level) {
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "platform::tests::dispatch_follows_the_detected_platform",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("WEIGHTCAST_SIMD", value)
            .env("WEIGHTCAST_DISPATCH_CHILD", value)
            .output()
            .expect("run the test binary");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && stdout.contains(&format!("every site ran code at or below {cap} only")),
            "child with WEIGHTCAST_SIMD={value} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `WEIGHTCAST_SIMD=off` routes every dispatch point to portable code.
    #[test]
    fn the_off_switch_routes_every_kernel_to_portable_code() {
        child_with_cap("off", Level::Portable);
    }

    /// `WEIGHTCAST_SIMD=avx2` keeps the AVX-512 kernels out (what a host
    /// without AVX-512 runs), while the AVX2 forms still run where the CPU
    /// has them (the test above checks each site took its allowed form).
    #[test]
    fn the_avx2_cap_keeps_avx512_kernels_out() {
        child_with_cap("avx2", Level::Avx2);
    }

    #[test]
    fn cap_values() {
        assert_eq!(cap_named(None), Level::Avx512Vbmi2);
        assert_eq!(cap_named(Some("on")), Level::Avx512Vbmi2);
        assert_eq!(cap_named(Some("OFF")), Level::Portable);
        assert_eq!(cap_named(Some("portable")), Level::Portable);
        assert_eq!(cap_named(Some("avx2")), Level::Avx2);
        assert_eq!(cap_named(Some(" AVX512 ")), Level::Avx512);
    }
}
