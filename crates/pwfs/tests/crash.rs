//! Crash consistency: run a seeded workload on the simulated device, then for every
//! point of its write/flush log build the image a crash there could leave (flushed
//! writes, plus a random subset of unflushed sectors, torn within blocks), and check:
//! fsck is clean before and after recovery, recovery is idempotent (a crash during
//! replay changes nothing), and the recovered tree equals the state of the last
//! completed sync or of the one in flight — every fsync'd byte and name is there.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::sim::{crash_image, Event, LogEntry, SimConfig, SimDevice};
use pwfs::{Config, Fs, MkfsOptions, Stack};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    dirs: BTreeSet<String>,
    /// path → file id
    names: BTreeMap<String, u64>,
    /// file id → content
    data: BTreeMap<u64, Vec<u8>>,
    /// In a snapshot: every content each file had since the previous snapshot. Data
    /// written back without a commit (dirty-data pressure) may be any of them after a
    /// crash, for bytes overwritten in place.
    interim: BTreeMap<u64, Vec<Vec<u8>>>,
}

impl Model {
    /// A file that lost a name: its data goes with its last one.
    fn forget_unnamed(&mut self, id: u64) {
        if !self.names.values().any(|v| *v == id) {
            self.data.remove(&id);
        }
    }
}

/// Position-encoded contents: every aligned 8 bytes of a file carry the file's id,
/// their offset and the version of the write that put them there, so that a block
/// read back from the wrong place (another file, another offset, a stale copy) never
/// matches, even where a byte pattern would.
fn word(id: u64, offset: u64, version: u64) -> [u8; 8] {
    let w = (id & 0xffff) << 48 | ((offset / 8) & 0xffff_ffff) << 16 | (version & 0xffff) | 1 << 15;
    w.to_le_bytes()
}

/// The bytes a write of `len` bytes at `off` of file `id` carries, as version `version`.
fn encoded(id: u64, off: u64, len: usize, version: u64) -> Vec<u8> {
    (off..off + len as u64).map(|p| word(id, p & !7, version)[(p & 7) as usize]).collect()
}

fn pick<'a>(rng: &mut SmallRng, v: &'a [String]) -> Option<&'a String> {
    (!v.is_empty()).then(|| &v[rng.gen_range(0..v.len())])
}

/// Run the workload; returns the model after each completed sync, with the log
/// length at that moment.
fn workload(fs: &Fs, dev: &SimDevice, seed: u64, steps: usize) -> Vec<(usize, Model)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut m = Model::default();
    m.dirs.insert(String::new());
    let mut syncs = vec![(dev.log_len(), m.clone())];
    let mut interim: BTreeMap<u64, Vec<Vec<u8>>> = BTreeMap::new();
    let snapshot = |m: &Model, interim: &mut BTreeMap<u64, Vec<Vec<u8>>>| {
        let mut s = m.clone();
        s.interim = std::mem::take(interim);
        s
    };
    let mut next_id = 0;
    for step in 0..steps {
        // Commits also happen inside operations (a full journal, too much dirty
        // data); each leaves the state after its operation durable.
        let mut commits = fs.journal_stats().commits;
        let dirs: Vec<String> = m.dirs.iter().cloned().collect();
        let files: Vec<String> = m.names.keys().cloned().collect();
        match rng.gen_range(0..100) {
            0..=24 => {
                let dir = pick(&mut rng, &dirs).unwrap().clone();
                let path = format!("{dir}/f{step}");
                let len = [0, 100, 4096, 5000, 20_000, 70_000][rng.gen_range(0..6)];
                let content = encoded(next_id + 1, 0, len, step as u64 + 1);
                // Two operations, each of which may commit at its end.
                let f = fs.create(&path).unwrap();
                next_id += 1;
                m.names.insert(path, next_id);
                m.data.insert(next_id, Vec::new());
                if fs.journal_stats().commits != commits {
                    syncs.push((dev.log_len(), snapshot(&m, &mut interim)));
                    // The write that follows is durable only if it commits too.
                    commits = fs.journal_stats().commits;
                }
                f.write_at(&content, 0).unwrap();
                interim.entry(next_id).or_default().push(content.clone());
                m.data.insert(next_id, content);
            }
            25..=44 => {
                let Some(path) = pick(&mut rng, &files).cloned() else {
                    continue;
                };
                let id = m.names[&path];
                let content = m.data.get_mut(&id).unwrap();
                let off = rng.gen_range(0..=content.len() + 5000) as u64;
                let len = rng.gen_range(1..9000);
                let bytes = encoded(id, off, len, step as u64 + 1);
                let f = pwfs::OpenOptions::new().write(true).open(fs, &path).unwrap();
                f.write_at(&bytes, off).unwrap();
                let end = off as usize + len;
                if content.len() < end {
                    content.resize(end, 0);
                }
                content[off as usize..end].copy_from_slice(&bytes);
                interim.entry(id).or_default().push(content.clone());
            }
            45..=54 => {
                let Some(path) = pick(&mut rng, &files).cloned() else {
                    continue;
                };
                let id = m.names[&path];
                let content = m.data.get_mut(&id).unwrap();
                let size = rng.gen_range(0..=content.len() + 3000);
                fs.set_len(&path, size as u64).unwrap();
                content.resize(size, 0);
                interim.entry(id).or_default().push(content.clone());
            }
            55..=59 => {
                let Some(path) = pick(&mut rng, &files).cloned() else {
                    continue;
                };
                fs.remove_file(&path).unwrap();
                let id = m.names.remove(&path).unwrap();
                m.forget_unnamed(id);
            }
            60..=64 => {
                // A second name, in any directory (its data is the same file's).
                let Some(path) = pick(&mut rng, &files).cloned() else {
                    continue;
                };
                let dir = pick(&mut rng, &dirs).unwrap().clone();
                let to = format!("{dir}/l{step}");
                fs.hard_link(&path, &to).unwrap();
                m.names.insert(to, m.names[&path]);
            }
            65..=74 => {
                let Some(path) = pick(&mut rng, &files).cloned() else {
                    continue;
                };
                // Half the time over an existing file (the write-a-copy-then-rename
                // idiom): the name must show the whole old or the whole new file.
                let to = match pick(&mut rng, &files).filter(|t| **t != path && rng.gen_bool(0.5)) {
                    Some(t) => t.clone(),
                    None => format!("{}/r{step}", pick(&mut rng, &dirs).unwrap()),
                };
                fs.rename_path(&path, &to).unwrap();
                let id = m.names[&path];
                if m.names.get(&to) == Some(&id) {
                    // Two names of one file: rename(2) does nothing.
                    continue;
                }
                m.names.remove(&path);
                if let Some(old) = m.names.insert(to, id) {
                    if old != id {
                        m.forget_unnamed(old);
                    }
                }
            }
            75..=81 => {
                let dir = pick(&mut rng, &dirs).unwrap().clone();
                if dir.matches('/').count() < 3 {
                    let path = format!("{dir}/d{step}");
                    fs.create_dir(&path, 0o755).unwrap();
                    m.dirs.insert(path);
                }
            }
            82..=85 => {
                // Remove an empty directory.
                let empty: Vec<String> = dirs
                    .iter()
                    .filter(|d| !d.is_empty())
                    .filter(|d| {
                        let pre = format!("{d}/");
                        !m.dirs.iter().any(|x| x.starts_with(&pre)) && !m.names.keys().any(|x| x.starts_with(&pre))
                    })
                    .cloned()
                    .collect();
                let Some(d) = pick(&mut rng, &empty).cloned() else {
                    continue;
                };
                fs.remove_dir(&d).unwrap();
                m.dirs.remove(&d);
            }
            _ => {
                fs.sync().unwrap();
                fs.evict_cache().unwrap();
            }
        }
        if fs.journal_stats().commits != commits {
            syncs.push((dev.log_len(), snapshot(&m, &mut interim)));
        }
    }
    fs.sync().unwrap();
    syncs.push((dev.log_len(), snapshot(&m, &mut interim)));
    // Without a crash the tree is exactly the model, cached and cold.
    matches(&observe(fs), &m, None).expect("live tree matches the model");
    fs.evict_cache().unwrap();
    matches(&observe(fs), &m, None).expect("tree read cold matches the model");
    syncs
}

/// Read the whole tree of a mounted file system into a model (ids left 0).
fn observe(fs: &Fs) -> (BTreeSet<String>, BTreeMap<String, Vec<u8>>) {
    let mut dirs = BTreeSet::new();
    let mut files = BTreeMap::new();
    let mut stack = vec![String::new()];
    while let Some(d) = stack.pop() {
        dirs.insert(d.clone());
        let path = if d.is_empty() { "/".to_string() } else { d.clone() };
        for e in fs.read_dir(&path).unwrap() {
            let p = format!("{d}/{}", String::from_utf8(e.name).unwrap());
            if e.kind == pwfs::FileType::Directory {
                stack.push(p);
            } else {
                files.insert(p.clone(), fs.read_file(&p).unwrap());
            }
        }
    }
    (dirs, files)
}

/// Does the observed tree match `a` (allowing bytes of in-place overwrites from `b`)?
fn matches(obs: &(BTreeSet<String>, BTreeMap<String, Vec<u8>>), a: &Model, b: Option<&Model>) -> Result<(), String> {
    if obs.0 != a.dirs {
        return Err(format!("directories differ: {:?} vs {:?}", obs.0, a.dirs));
    }
    let names: BTreeSet<&String> = a.names.keys().collect();
    if obs.1.keys().collect::<BTreeSet<_>>() != names {
        return Err(format!("names differ: {:?} vs {:?}", obs.1.keys().collect::<Vec<_>>(), names));
    }
    for (path, id) in &a.names {
        let want = &a.data[id];
        let got = &obs.1[path];
        if got.len() != want.len() {
            return Err(format!("{path}: size {} but {} synced", got.len(), want.len()));
        }
        // Bytes overwritten in place since `a` may hold any later version of them.
        let mut alts: Vec<&Vec<u8>> = Vec::new();
        if let Some(b) = b {
            alts.extend(b.data.get(id));
            alts.extend(b.interim.get(id).into_iter().flatten());
        }
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            if g != w && !alts.iter().any(|x| x.get(i) == Some(g)) {
                return Err(format!("{path}: byte {i} is {g}, synced {w}"));
            }
        }
    }
    Ok(())
}

fn mount_mem(img: Vec<u8>) -> (Arc<MemDevice>, Fs) {
    let dev = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::mount(dev.clone(), test_config()).expect("a crash image must mount");
    (dev, fs)
}

fn check_point(base: &[u8], log: &[pwfs::device::sim::LogEntry], syncs: &[(usize, Model)], k: usize, seed: u64) {
    let ctx = format!("seed {seed}, crash after log entry {k} of {}", log.len());
    let img = crash_image(base, log, k, seed ^ (k as u64).wrapping_mul(0x9e37_79b9));
    // fsck of the raw crash image (as the journal leaves it) must already be clean.
    let r = pwfs::fsck::check(&MemDevice::from_vec(img.clone())).unwrap();
    assert!(r.is_clean(), "{ctx}: fsck before recovery:\n{}", r.errors.join("\n"));
    // The last sync that completed before the crash, and the one that may have.
    let i = syncs.iter().rposition(|(at, _)| *at <= k).expect("the initial state is a sync point");
    let (a, b) = (&syncs[i].1, syncs.get(i + 1).map(|s| &s.1));

    // Recovery, crashed part-way through at a random point, then recovered again.
    let rec = Arc::new(SimDevice::new(img.clone(), SimConfig::default()));
    let rec_base = rec.start_recording();
    drop(Fs::mount(rec.clone(), test_config()).unwrap_or_else(|e| panic!("{ctx}: mount: {e}")));
    let rlog = rec.log();
    let cut = if rlog.is_empty() { 0 } else { (seed as usize ^ k) % rlog.len() };
    let img2 = crash_image(&rec_base, &rlog, cut, seed.wrapping_add(k as u64));

    for (which, img) in [("after recovery", img), ("after a crash during recovery", img2)] {
        let (dev, fs) = mount_mem(img);
        let obs = observe(&fs);
        let ok = matches(&obs, a, b);
        let ok =
            ok.or_else(|e1| b.map_or(Err(e1.clone()), |b| matches(&obs, b, None)).map_err(|e2| format!("{e1} / {e2}")));
        if let Err(e) = ok {
            panic!("{ctx}: {which}: tree is neither the last synced state nor the next: {e}");
        }
        fs.unmount().unwrap();
        let r = pwfs::fsck::check(&*dev).unwrap();
        assert!(r.is_clean(), "{ctx}: {which}: fsck after unmount:\n{}", r.errors.join("\n"));
        assert!(r.notes.is_empty(), "{ctx}: {which}: unmount left: {:?}", r.notes);
    }
}

fn run(seed: u64, steps: usize, points: usize) {
    run_with(seed, steps, points, pwfs::FetchPolicy::Blocking, Stack::Sync)
}

/// The ordered-mode rule, checked on what the device saw: every commit block is
/// written after a flush that came after every write since the previous commit block
/// (data, checkpoint, superblock), each of which the caller had seen complete before
/// that flush was issued (or which went before the flush in the flush's own batch).
/// Writes to the journal's log (`log`: its byte range) are exempt: the commit block's
/// checksum covers its transaction's descriptors and images, so the asynchronous stack
/// writes it beside them when no data is in flight (a torn body fails the checksum).
/// Returns the number of commit blocks checked.
fn check_commit_order(events: &[Event], log: &[LogEntry], journal: std::ops::Range<u64>) -> Result<usize, String> {
    let mut writes = log.iter().filter(|e| !matches!(e, LogEntry::Flush));
    let mut since: Vec<u64> = Vec::new(); // batches of the writes since the last commit block
    let mut completed: BTreeSet<u64> = BTreeSet::new();
    // The last flush, and the batches known complete (or in its batch) when it came.
    let mut last_flush: Option<(usize, u64, BTreeSet<u64>)> = None;
    let mut commits = 0;
    for (i, e) in events.iter().enumerate() {
        match e {
            Event::Completed { batch } => {
                completed.insert(*batch);
            }
            Event::Flush { batch } => {
                let mut covered = completed.clone();
                covered.insert(*batch);
                last_flush = Some((i, *batch, covered));
            }
            Event::Write { batch, len, offset, .. } => {
                let data = match writes.next() {
                    Some(LogEntry::Write { data, .. } | LogEntry::WriteFua { data, .. }) => data,
                    _ => return Err(format!("event {i}: a write the log does not have")),
                };
                let magic = u32::from_le_bytes(data[..4].try_into().unwrap());
                if *len != 4096 || magic != pwfs::format::JCOMMIT_MAGIC {
                    if !journal.contains(offset) {
                        since.push(*batch);
                    }
                    continue;
                }
                let Some((_, _, covered)) = &last_flush else {
                    return Err(format!("event {i}: a commit block with no flush before it"));
                };
                if let Some(b) = since.iter().find(|b| !covered.contains(b)) {
                    return Err(format!(
                        "event {i}: commit block written before a flush covered batch {b} (not seen complete)"
                    ));
                }
                // Every write since the last commit block came before that flush.
                let flush_at = last_flush.as_ref().unwrap().0;
                let after = events[flush_at + 1..i]
                    .iter()
                    .any(|e| matches!(e, Event::Write { batch, .. } if since.contains(batch)));
                if after {
                    return Err(format!("event {i}: a write between the last flush and the commit block"));
                }
                since.clear();
                commits += 1;
            }
        }
    }
    Ok(commits)
}

fn run_with(seed: u64, steps: usize, points: usize, fetch: pwfs::FetchPolicy, stack: Stack) {
    run_full(seed, steps, points, fetch, stack, true)
}

/// `run_with`, with hitchhiking (mechanism 3) on or off.
fn run_full(seed: u64, steps: usize, points: usize, fetch: pwfs::FetchPolicy, stack: Stack, hitchhike: bool) {
    // A small journal, so the workload also crosses checkpoints.
    let image = formatted_image(8 * MIB, &MkfsOptions { inodes: Some(512), journal_blocks: Some(96) });
    // Under the asynchronous stack a request completes a little after it starts, so
    // that data, journal body and commit-block building really overlap.
    let latency = if stack == Stack::Async { std::time::Duration::from_micros(20) } else { Default::default() };
    let dev = Arc::new(SimDevice::new(image, SimConfig { seed, latency, ..Default::default() }));
    // The workload starts cold after every sync, so its overwrites hit pages that are
    // not in memory: under a non-blocking policy they are patches at the crash.
    let base = dev.start_recording();
    let fs =
        Fs::mount(dev.clone(), Config { fetch, stack, hitchhike, cache_bytes: 64 * 4096, ..test_config() }).unwrap();
    let syncs = workload(&fs, &dev, seed, steps);
    let hh = fs.hitchhike_stats();
    assert_eq!(hitchhike, hh.hitchhiked + hh.meta_deltas > 0, "seed {seed}: hitchhiking exercised iff on: {hh:?}");
    drop(fs);
    let log = dev.log();
    let sb = pwfs::format::Superblock::decode(&base[..4096]).unwrap();
    let journal = (sb.journal_start + 1) * 4096..(sb.journal_start + sb.journal_blocks) * 4096;
    let commits =
        check_commit_order(&dev.events(), &log, journal).unwrap_or_else(|e| panic!("seed {seed}, {stack:?}: {e}"));
    assert!(commits > 0, "seed {seed}: the workload committed nothing");
    assert!(log.len() > points, "workload too small: {} log entries", log.len());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut ks: Vec<usize> = (0..points).map(|_| rng.gen_range(0..=log.len())).collect();
    ks.push(log.len());
    for k in &ks {
        check_point(&base, &log, &syncs, *k, seed);
    }
}

#[test]
fn crash_points_seed_1() {
    run(1, 600, 300);
}

#[test]
fn crash_points_seed_2() {
    run(2, 600, 300);
}

#[test]
fn crash_points_seed_3() {
    run(3, 600, 300);
}

#[test]
fn crash_points_seed_4() {
    run(4, 600, 300);
}

#[test]
fn crash_points_with_patches_lazy() {
    run_with(5, 400, 150, pwfs::FetchPolicy::Lazy, Stack::Sync);
}

#[test]
fn crash_points_with_patches_async_background() {
    run_with(6, 400, 150, pwfs::FetchPolicy::AsyncBackground, Stack::Sync);
}

#[test]
fn crash_points_with_patches_async_foreground() {
    run_with(7, 400, 150, pwfs::FetchPolicy::AsyncForeground, Stack::Sync);
}

/// The asynchronous stack (overlapped commit, reads submitted before their cache
/// entries), under the same crash points and the same ordered-mode check.
#[test]
fn crash_points_async_stack_seed_1() {
    run_with(11, 400, 200, pwfs::FetchPolicy::Blocking, Stack::Async);
}

#[test]
fn crash_points_async_stack_seed_2() {
    run_with(12, 400, 200, pwfs::FetchPolicy::Blocking, Stack::Async);
}

#[test]
fn crash_points_async_stack_with_patches() {
    run_with(13, 400, 150, pwfs::FetchPolicy::AsyncBackground, Stack::Async);
}

/// Without hitchhiking: every fsync'd block written whole, in place.
#[test]
fn crash_points_without_hitchhiking() {
    run_full(21, 400, 200, pwfs::FetchPolicy::Blocking, Stack::Sync, false);
    run_full(22, 400, 200, pwfs::FetchPolicy::AsyncBackground, Stack::Async, false);
}

/// Twenty more seeds across all fetch policies and both stacks, on request:
/// `PWFS_CRASH_SEEDS=100 cargo test --release --test crash -- --ignored` runs 100..120.
#[test]
#[ignore = "long; run on request with PWFS_CRASH_SEEDS"]
fn crash_points_env_seeds() {
    let start: u64 = std::env::var("PWFS_CRASH_SEEDS").map_or(1000, |s| s.parse().unwrap());
    let policies = [
        pwfs::FetchPolicy::Blocking,
        pwfs::FetchPolicy::AsyncForeground,
        pwfs::FetchPolicy::AsyncBackground,
        pwfs::FetchPolicy::Lazy,
    ];
    for seed in start..start + 20 {
        let stack = if seed % 2 == 0 { Stack::Sync } else { Stack::Async };
        run_with(seed, 400, 200, policies[seed as usize % 4], stack);
    }
}

/// fdatasync: an overwrite in place is durable after one data write and a flush (no
/// journal commit); a write that grows the file commits its new size as well.
#[test]
fn fdatasync_makes_data_durable() {
    for seed in 0..40u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let image = formatted_image(8 * MIB, &MkfsOptions { inodes: Some(256), journal_blocks: Some(64) });
        let dev = Arc::new(SimDevice::new(image, SimConfig { seed, ..Default::default() }));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        let mut model = vec![1u8; 50_000];
        fs.write_file("/f", &model).unwrap();
        fs.sync().unwrap();
        let f = pwfs::OpenOptions::new().write(true).open(&fs, "/f").unwrap();
        let commits = fs.journal_stats().commits;
        let flushes = dev.stats().flushes;
        let base = dev.start_recording();
        let mut overwrites_only = true;
        for _ in 0..rng.gen_range(1..6) {
            let off = rng.gen_range(0..model.len() + 10_000);
            let len = rng.gen_range(1..9000);
            let v: u8 = rng.gen_range(2..255);
            f.write_at(&vec![v; len], off as u64).unwrap();
            if model.len() < off + len {
                model.resize(off + len, 0);
                overwrites_only = false;
            }
            model[off..off + len].fill(v);
            f.sync_data().unwrap();
        }
        if overwrites_only {
            assert_eq!(fs.journal_stats().commits, commits, "seed {seed}: overwrites need no commit");
            assert!(dev.stats().flushes > flushes);
        }
        let log = dev.log();
        drop(f);
        drop(fs);
        // Crash right after the last fdatasync returned: everything it covered is there.
        let img = crash_image(&base, &log, log.len(), seed);
        let (_d, fs) = mount_mem(img);
        assert_eq!(fs.read_file("/f").unwrap(), model, "seed {seed}");
        // Crashes at earlier points leave a consistent file system.
        for k in [0, log.len() / 3, log.len() / 2] {
            let img = crash_image(&base, &log, k, seed + k as u64);
            let r = pwfs::fsck::check(&MemDevice::from_vec(img)).unwrap();
            assert!(r.is_clean(), "seed {seed} point {k}: {:?}", r.errors);
        }
    }
}

/// fdatasync of a file just created, still empty, makes its name durable (as ext4,
/// which records the creating transaction for fdatasync): a crash right after it
/// keeps the file.
#[test]
fn fdatasync_of_a_new_empty_file_keeps_it() {
    for seed in 0..8u64 {
        let image = formatted_image(16 * MIB, &pwfs::MkfsOptions::default());
        let dev = Arc::new(SimDevice::new(image, SimConfig { seed, ..Default::default() }));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        let f = fs.create("/new").unwrap();
        f.sync_data().unwrap();
        let log = dev.log();
        drop(f);
        drop(fs);
        let img = crash_image(&base, &log, log.len(), seed);
        let (_d, fs) = mount_mem(img);
        assert_eq!(fs.metadata("/new").map(|m| m.size).ok(), Some(0), "seed {seed}");
    }
}

/// A truncate into the middle of a block on a device too full for the usual room
/// (free blocks within the metadata reserve): the zeroed tail still never overwrites
/// its block in place before the truncate commits, so a crash anywhere shows the file
/// at its old size with its old bytes, or at its new size.
#[test]
fn a_truncate_on_a_nearly_full_device_never_shows_zeros_inside_the_old_size() {
    for seed in 0..4u64 {
        let image = formatted_image(8 * MIB, &MkfsOptions::default());
        let config = Config { hitchhike: false, ..test_config() };
        let dev = Arc::new(SimDevice::new(image, SimConfig { seed, ..Default::default() }));
        let fs = Fs::mount(dev.clone(), config.clone()).unwrap();
        let old: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        fs.write_file("/f", &old).unwrap();
        fs.sync().unwrap();
        // Fill the device until a write is refused: what is free then is the reserve.
        let fill = pwfs::OpenOptions::new().write(true).create(true).open(&fs, "/fill").unwrap();
        let mut at = 0u64;
        while fill.write_at(&[7u8; 4096], at).is_ok() {
            at += 4096;
            if at.is_multiple_of(64 * 4096) {
                fs.sync().unwrap();
            }
        }
        drop(fill);
        fs.sync().unwrap();
        let base = dev.start_recording();
        fs.set_len("/f", 100).unwrap();
        fs.sync().unwrap();
        let log = dev.log();
        drop(fs);
        for k in 0..=log.len() {
            let img = crash_image(&base, &log, k, seed * 1000 + k as u64);
            let (_d, fs) = mount_mem(img);
            let got = fs.read_file("/f").unwrap();
            assert!(
                got == old || got == old[..100],
                "seed {seed} crash point {k} of {}: {} bytes, first differing at {:?}",
                log.len(),
                got.len(),
                got.iter().zip(&old).position(|(a, b)| a != b)
            );
            if k == log.len() {
                assert_eq!(got, old[..100], "the synced truncate");
            }
        }
    }
}

/// On a full device, truncates into the middle of blocks take their tails' new blocks
/// from the metadata reserve, and when half of it is gone, commit so that the blocks
/// the truncates before gave back are free again: all of them go through, with no
/// sync in between, and leave exactly the bytes asked for.
#[test]
fn truncates_on_a_full_device_go_through_as_their_commits_give_blocks_back() {
    let image = formatted_image(8 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), Config { hitchhike: false, ..test_config() });
    let old: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8 + 1).collect();
    let names: Vec<String> = (0..64).map(|i| format!("/t{i}")).collect();
    for n in &names {
        fs.write_file(n, &old).unwrap();
    }
    fs.sync().unwrap();
    let fill = pwfs::OpenOptions::new().write(true).create(true).open(&fs, "/fill").unwrap();
    let mut at = 0u64;
    while fill.write_at(&[7u8; 4096], at).is_ok() {
        at += 4096;
    }
    drop(fill);
    fs.sync().unwrap();
    let commits = fs.journal_stats().commits;
    for n in &names {
        fs.set_len(n, 100).unwrap();
        assert_eq!(fs.read_file(n).unwrap(), old[..100]);
    }
    assert!(fs.journal_stats().commits > commits, "the reserve never ran low: the test shows nothing");
    fs.unmount().unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    for n in &names {
        assert_eq!(fs.read_file(n).unwrap(), old[..100], "{n}");
    }
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// fsync covers a file's metadata (POSIX): its mode, owner, times and extended
/// attributes, changed just before, are all there after a crash at any point after the
/// fsync returned, each crash image torn its own way; and at no earlier point is a
/// change there without the ones made before it.
#[test]
fn metadata_changed_before_an_fsync_survives_a_crash() {
    for seed in 0..4u64 {
        let image = formatted_image(8 * MIB, &MkfsOptions::default());
        let dev = Arc::new(SimDevice::new(image, SimConfig { seed, ..Default::default() }));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.write_file("/f", b"data").unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        let when = pwfs::format::Timespec { sec: 1_000_000_000 + seed as i64, nsec: 123 };
        fs.set_permissions("/f", 0o640).unwrap();
        fs.set_owner("/f", Some(1000 + seed as u32), Some(2000)).unwrap();
        fs.set_times("/f", None, Some(pwfs::TimeSet::At(when))).unwrap();
        let ino = fs.metadata("/f").unwrap().ino;
        fs.setxattr(ino, b"user.k", &vec![7u8; 300], false, false).unwrap();
        let f = pwfs::OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
        f.sync_all().unwrap();
        let log = dev.log();
        drop(f);
        drop(fs);
        for k in 0..=log.len() {
            let img = crash_image(&base, &log, k, seed * 1000 + k as u64);
            let (_d, fs) = mount_mem(img);
            let md = fs.metadata("/f").unwrap();
            let xattr = fs.getxattr(ino, b"user.k").ok();
            // The changes were made in order and commit together or not at all here
            // (one transaction): all of them or none.
            let all = md.mode & 0o7777 == 0o640
                && md.uid == 1000 + seed as u32
                && md.gid == 2000
                && md.mtime == when
                && xattr.as_deref() == Some(&[7u8; 300][..]);
            let none = md.mode & 0o7777 != 0o640 && md.uid == 0 && xattr.is_none();
            assert!(all || none, "seed {seed} crash point {k} of {}: {md:?} xattr {xattr:?}", log.len());
            if k == log.len() {
                assert!(all, "seed {seed}: the fsync'd metadata is lost: {md:?}");
            }
        }
    }
}

/// A file unlinked while open is an orphan: a crash while it is still open leaves it to
/// the next mount, which frees it (its inode and every block), at every crash point:
/// before the unlink's commit the file is there whole, after it the space is exactly
/// what it was before the file was made.
#[test]
fn an_open_unlinked_file_is_freed_by_the_mount_after_a_crash() {
    for seed in 0..3u64 {
        let image = formatted_image(8 * MIB, &MkfsOptions::default());
        let dev = Arc::new(SimDevice::new(image, SimConfig { seed, ..Default::default() }));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.write_file("/keep", &encoded(1, 0, 5000, 1)).unwrap();
        fs.sync().unwrap();
        let before = fs.statfs();
        let old = encoded(2, 0, 100_000, 1);
        fs.write_file("/o", &old).unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        let f = pwfs::OpenOptions::new().read(true).write(true).open(&fs, "/o").unwrap();
        f.write_at(&encoded(2, 100_000, 50_000, 2), 100_000).unwrap();
        fs.remove_file("/o").unwrap();
        fs.sync().unwrap();
        let log = dev.log();
        assert!(fs.metadata("/o").is_err());
        for k in 0..=log.len() {
            let img = crash_image(&base, &log, k, seed * 1000 + k as u64);
            let dev = Arc::new(MemDevice::from_vec(img));
            let (fs, report) = Fs::mount_report(dev.clone(), test_config()).expect("a crash image must mount");
            match fs.read_file("/o") {
                Ok(got) => assert_eq!(got, old, "seed {seed} point {k}: the file before its unlink committed"),
                Err(_) => {
                    let now = fs.statfs();
                    assert_eq!(
                        (now.blocks_free, now.inodes_free),
                        (before.blocks_free, before.inodes_free),
                        "seed {seed} point {k}: the orphan's space came back ({report:?})"
                    );
                }
            }
            if k == log.len() {
                assert!(fs.read_file("/o").is_err(), "the synced unlink");
                assert_eq!(report.orphans_freed, 1, "the open file was an orphan");
            }
            assert_eq!(fs.read_file("/keep").unwrap(), encoded(1, 0, 5000, 1));
            fs.unmount().unwrap();
            fsck_clean(&*dev);
        }
        drop(f);
    }
}
