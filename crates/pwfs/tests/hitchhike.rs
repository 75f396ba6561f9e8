//! Hitchhiking (mechanism 3): small fsync'd writes ride as deltas in the commit block.
//! What the device sees per fsync, and that every fsync'd byte survives a crash at any
//! point (torn and dropped writes, crashes during recovery), across checkpoints,
//! retirement of idle blocks, and frees of carried blocks.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::sim::{crash_image, SimConfig, SimDevice};
use pwfs::{Config, Fs, MkfsOptions, OpenOptions, Stack};
use std::sync::Arc;

fn config(stack: Stack, hitchhike: bool) -> Config {
    Config { stack, hitchhike, ..test_config() }
}

/// Bytes that differ at every position and from every other record (so that a stale
/// or misplaced block never matches).
fn record(i: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|j| (i.wrapping_mul(131) ^ j.wrapping_mul(7) ^ (i >> 8)) as u8 | 1).collect()
}

/// Bytes that do not compress (a delta of them does not fit a commit block).
fn noise(i: u64, len: usize) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(i);
    (0..len).map(|_| rng.gen()).collect()
}

/// Append `n` records of `len` bytes to /log with an fsync after each; returns the
/// device's log length after each fsync returned, and the file's contents then.
fn appends(fs: &Fs, dev: &SimDevice, n: u64, len: usize, datasync: bool) -> Vec<(usize, Vec<u8>)> {
    let f = OpenOptions::new().write(true).create(true).open(fs, "/log").unwrap();
    let mut content = Vec::new();
    let mut out = vec![(dev.log_len(), Vec::new())];
    for i in 0..n {
        let r = if len >= 4096 { noise(i, len) } else { record(i, len) };
        f.write_at(&r, content.len() as u64).unwrap();
        content.extend_from_slice(&r);
        if datasync {
            f.sync_data().unwrap();
        } else {
            f.sync_all().unwrap();
        }
        out.push((dev.log_len(), content.clone()));
    }
    out
}

fn read_all(fs: &Fs, path: &str) -> Vec<u8> {
    let f = OpenOptions::new().read(true).open(fs, path).unwrap();
    let size = fs.metadata(path).unwrap().size as usize;
    let mut buf = vec![0u8; size];
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), size);
    buf
}

#[test]
fn a_small_append_and_fsync_costs_one_write_and_no_flush_of_its_own() {
    for stack in [Stack::Async, Stack::Sync] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), config(stack, true));
        let f = OpenOptions::new().write(true).create(true).open(&fs, "/log").unwrap();
        f.write_at(b"first", 0).unwrap();
        f.sync_all().unwrap();
        let before = dev.stats();
        let hh = fs.hitchhike_stats();
        let n = 50u64;
        for i in 0..n {
            f.write_at(&record(i, 64), 5 + i * 64).unwrap();
            f.sync_all().unwrap();
        }
        let after = dev.stats();
        let hh2 = fs.hitchhike_stats();
        let writes = after.writes - before.writes;
        let flushes = after.flushes - before.flushes;
        match stack {
            // The commit block alone, written through (FUA).
            Stack::Async => {
                assert_eq!(writes, n, "{stack:?}: one write per fsync");
                assert_eq!(after.fua_writes - before.fua_writes, n);
                assert_eq!(flushes, 0, "{stack:?}: no flush besides the FUA write");
            }
            // The commit block, then a flush.
            Stack::Sync => {
                assert_eq!(writes, n, "{stack:?}: one write per fsync");
                assert_eq!(flushes, n, "{stack:?}: one flush per fsync");
            }
        }
        assert_eq!(hh2.hitchhiked - hh.hitchhiked, n, "{stack:?}: every append hitchhiked");
        assert_eq!(hh2.commit_only - hh.commit_only, n);
        assert!(hh2.meta_deltas - hh.meta_deltas >= n, "{stack:?}: the inode rides as a delta too");
        drop(f);
        // Unmount writes the carried blocks home; the image is whole without a journal.
        fs.unmount().unwrap();
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), config(stack, false)).unwrap();
        let got = read_all(&fs, "/log");
        assert_eq!(&got[..5], b"first");
        for i in 0..n {
            let at = 5 + i as usize * 64;
            assert_eq!(got[at..at + 64], record(i, 64)[..], "{stack:?}: record {i}");
        }
    }
}

#[test]
fn a_block_append_is_logged_whole_with_one_flush() {
    // A journal of 1,024 blocks: the buffer holds 63 blocks (a sixteenth of it).
    let image = formatted_image(16 * MIB, &MkfsOptions { inodes: None, journal_blocks: Some(1024) });
    let (dev, fs) = sim_fs(image, SimConfig::default(), config(Stack::Async, true));
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/log").unwrap();
    f.write_at(&noise(0, 4096), 0).unwrap();
    f.sync_all().unwrap();
    let before = dev.stats();
    let n = 20u64;
    for i in 1..=n {
        f.write_at(&noise(i, 4096), i * 4096).unwrap();
        f.sync_all().unwrap();
    }
    let after = dev.stats();
    // Descriptor and image, commit block beside them, one flush: no flush before the
    // commit block, since no data was written in place.
    assert_eq!(after.flushes - before.flushes, n, "one flush per fsync");
    assert_eq!(after.fua_writes - before.fua_writes, 0);
    assert!(after.writes - before.writes <= 2 * n, "body and commit block: {}", after.writes - before.writes);
    assert_eq!(fs.hitchhike_stats().hitchhiked, 0, "4 KiB of noise does not compress");
    assert!(fs.hitchhike_stats().data_images >= n);
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let got = read_all(&fs, "/log");
    for i in 0..=n {
        assert_eq!(got[i as usize * 4096..(i as usize + 1) * 4096], noise(i, 4096)[..], "block {i}");
    }
}

#[test]
fn crash_points_of_block_appends_logged_whole() {
    crash_points(Stack::Async, 4096, 60, 256, false);
}

#[test]
fn off_switch_writes_blocks_whole() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), config(Stack::Async, false));
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/log").unwrap();
    f.write_at(b"first", 0).unwrap();
    f.sync_all().unwrap();
    let before = dev.stats();
    for i in 0..20u64 {
        f.write_at(&record(i, 64), 5 + i * 64).unwrap();
        f.sync_all().unwrap();
    }
    let after = dev.stats();
    assert!(after.writes - before.writes >= 40, "data block and journal per fsync");
    assert_eq!(fs.hitchhike_stats().hitchhiked, 0);
    assert_eq!(fs.hitchhike_stats().meta_deltas, 0);
}

/// The image a power cut after log entry `k` leaves (torn and dropped writes drawn from
/// `seed`), checked clean by fsck as the journal leaves it, and that image after a
/// recovery that itself crashed part-way (at entry `cut` modulo its log): the two
/// states a recovered mount must find right, named.
fn crash_images(
    base: &[u8],
    log: &[pwfs::device::sim::LogEntry],
    k: usize,
    seed: u64,
    cut: usize,
    ctx: &str,
) -> [(&'static str, Vec<u8>); 2] {
    let img = crash_image(base, log, k, seed);
    let r = pwfs::fsck::check(&MemDevice::from_vec(img.clone())).unwrap();
    assert!(r.is_clean(), "{ctx}: fsck before recovery:\n{}", r.errors.join("\n"));
    let rec = Arc::new(SimDevice::new(img.clone(), SimConfig::default()));
    let rec_base = rec.start_recording();
    drop(Fs::mount(rec.clone(), test_config()).unwrap_or_else(|e| panic!("{ctx}: mount: {e}")));
    let rlog = rec.log();
    let cut = if rlog.is_empty() { 0 } else { cut % rlog.len() };
    let img2 = crash_image(&rec_base, &rlog, cut, k as u64);
    [("recovered", img), ("recovered after a crash in recovery", img2)]
}

/// Every crash point of an append+fsync run: the recovered file holds at least what
/// the last fsync that returned had written, at most what the next one would, and a
/// crash during recovery changes nothing of that.
fn crash_points(stack: Stack, len: usize, n: u64, journal: u64, datasync: bool) {
    let image = formatted_image(8 * MIB, &MkfsOptions { inodes: Some(256), journal_blocks: Some(journal) });
    let latency = if stack == Stack::Async { std::time::Duration::from_micros(10) } else { Default::default() };
    let dev = Arc::new(SimDevice::new(image, SimConfig { latency, ..Default::default() }));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(stack, true)).unwrap();
    let syncs = appends(&fs, &dev, n, len, datasync);
    let hh = fs.hitchhike_stats();
    assert!(hh.hitchhiked + hh.data_images > 0, "nothing carried: {hh:?}");
    drop(fs);
    let log = dev.log();
    let step = (log.len() / 60).max(1);
    let mut checked = 0;
    for k in (0..=log.len()).step_by(step).chain([log.len()]) {
        let ctx = format!("{stack:?} len {len}: crash at {k} of {}", log.len());
        let i = syncs.iter().rposition(|(at, _)| *at <= k).unwrap();
        let low = &syncs[i].1;
        let high = &syncs.get(i + 1).unwrap_or(&syncs[i]).1;
        for (which, img) in crash_images(&base, &log, k, k as u64 * 31 + len as u64, k * 7, &ctx) {
            let dev = Arc::new(MemDevice::from_vec(img));
            let fs = Fs::mount(dev.clone(), test_config()).unwrap_or_else(|e| panic!("{ctx}: {which}: {e}"));
            let got = if fs.metadata("/log").is_ok() { read_all(&fs, "/log") } else { Vec::new() };
            assert!(
                got.len() >= low.len() && got.len() <= high.len(),
                "{ctx}: {which}: {} bytes, synced {} (next {})",
                got.len(),
                low.len(),
                high.len()
            );
            assert_eq!(got[..low.len()], low[..], "{ctx}: {which}: fsync'd bytes lost or wrong");
            assert_eq!(got[..], high[..got.len()], "{ctx}: {which}: bytes never written");
            fs.unmount().unwrap();
            fsck_clean(&*dev);
            checked += 1;
        }
    }
    assert!(checked > 20);
}

#[test]
fn crash_points_of_64_byte_appends() {
    crash_points(Stack::Async, 64, 150, 1024, false);
}

#[test]
fn crash_points_of_1k_appends_sync_stack_with_fdatasync() {
    crash_points(Stack::Sync, 1024, 40, 1024, true);
}

#[test]
fn crash_points_across_checkpoints() {
    // A journal of 64 blocks: the log fills and is checkpointed many times while
    // blocks are carried (their deltas must never lose their base).
    crash_points(Stack::Async, 200, 200, 64, false);
}

#[test]
fn a_freed_carried_block_is_revoked_before_reuse() {
    let image = formatted_image(8 * MIB, &MkfsOptions { inodes: Some(256), journal_blocks: Some(1024) });
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(Stack::Async, true)).unwrap();
    let a = OpenOptions::new().write(true).create(true).open(&fs, "/a").unwrap();
    for i in 0..10u64 {
        a.write_at(&record(i, 100), i * 100).unwrap();
        a.sync_all().unwrap();
    }
    assert!(fs.hitchhike_stats().buffered > 0);
    // Its blocks freed, and reused at once by a large write that goes in place.
    fs.remove_file("/a").unwrap();
    drop(a);
    fs.sync().unwrap();
    let b = OpenOptions::new().write(true).create(true).open(&fs, "/b").unwrap();
    let big: Vec<u8> = (0..64 * 4096u64).map(|i| (i % 251) as u8).collect();
    b.write_at(&big, 0).unwrap();
    b.sync_all().unwrap();
    drop(b);
    drop(fs);
    // The journal still holds /a's deltas: replay must not write them over /b.
    let log = dev.log();
    let img = crash_image(&base, &log, log.len(), 1);
    let dev = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert!(fs.metadata("/a").is_err());
    assert_eq!(read_all(&fs, "/b"), big);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn idle_blocks_are_written_home_and_leave_the_buffer() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let cfg = Config { writeback_interval: Some(std::time::Duration::from_millis(20)), ..config(Stack::Async, true) };
    let (dev, fs) = sim_fs(image, SimConfig::default(), cfg);
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/log").unwrap();
    for i in 0..8u64 {
        f.write_at(&record(i, 64), i * 64).unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(fs.hitchhike_stats().buffered, 1);
    // Idle: within a few intervals the block is written home and revoked.
    let t = std::time::Instant::now();
    while fs.hitchhike_stats().buffered > 0 {
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "block never retired");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(fs.hitchhike_stats().retired, 1);
    // The medium's copy is whole now, with the journal still holding the old deltas
    // (revoked): a crash image of this moment reads right.
    let img = dev.snapshot();
    let fs2 = Fs::mount(Arc::new(MemDevice::from_vec(img)), test_config()).unwrap();
    let got = read_all(&fs2, "/log");
    for i in 0..8usize {
        assert_eq!(got[i * 64..i * 64 + 64], record(i as u64, 64)[..]);
    }
    // Later appends hitchhike again, from a fresh durable version.
    f.write_at(&record(99, 64), 8 * 64).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn overwrites_in_a_preallocated_file_hitchhike_and_survive() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(Stack::Async, true)).unwrap();
    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/db").unwrap();
    f.allocate(0, 0, 16 * 4096).unwrap();
    f.sync_all().unwrap();
    let mut model = vec![0u8; 16 * 4096];
    let mut rng: u64 = 7;
    let mut durable = Vec::new();
    for i in 0..60u64 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let off = ((rng >> 33) % (16 * 4096 - 256)) as usize;
        let r = record(i, 256);
        f.write_at(&r, off as u64).unwrap();
        model[off..off + 256].copy_from_slice(&r);
        f.sync_data().unwrap();
        durable.push((dev.log_len(), model.clone()));
    }
    assert!(fs.hitchhike_stats().hitchhiked > 30, "{:?}", fs.hitchhike_stats());
    drop(f);
    drop(fs);
    let log = dev.log();
    for (k, want) in durable.iter().step_by(7) {
        let img = crash_image(&base, &log, *k, *k as u64);
        let fs = Fs::mount(Arc::new(MemDevice::from_vec(img)), test_config()).unwrap();
        assert_eq!(read_all(&fs, "/db"), *want, "crash after {k} of {}", log.len());
    }
}

#[test]
fn a_read_only_mount_reads_carried_data_from_the_journal() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(Stack::Async, true)).unwrap();
    let syncs = appends(&fs, &dev, 30, 100, false);
    drop(fs);
    // A power cut right after the last fsync: the carried block was never written home.
    let log = dev.log();
    let img = crash_image(&base, &log, syncs.last().unwrap().0, 3);
    let ro = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::mount(ro.clone(), Config { read_only: true, ..test_config() }).unwrap();
    assert_eq!(read_all(&fs, "/log"), syncs.last().unwrap().1);
    drop(fs);
    // Nothing was written: a writable mount still finds the journal to replay.
    let fs = Fs::mount(ro, test_config()).unwrap();
    assert_eq!(read_all(&fs, "/log"), syncs.last().unwrap().1);
}

#[test]
fn an_upgrade_torn_in_the_primary_superblock_is_finished_by_the_next_mount() {
    use pwfs::format::{Superblock, VERSION};
    let mut image = formatted_image(16 * MIB, &MkfsOptions::default());
    let backup = image.len() - 4096;
    let mut v1 = image[..4096].to_vec();
    let mut sb = Superblock::decode(&v1).unwrap();
    sb.version = 1;
    sb.encode(&mut v1);
    // The upgrade wrote the backup as version 2, then tore its write of the primary:
    // the first sector is new, the rest old.
    let mut v2 = v1.clone();
    Superblock { version: VERSION, clean: false, ..Superblock::decode(&v1).unwrap() }.encode(&mut v2);
    image[backup..].copy_from_slice(&v2);
    image[..4096].copy_from_slice(&v1);
    image[..512].copy_from_slice(&v2[..512]);
    assert!(Superblock::decode(&image[..4096]).is_err(), "a torn primary");
    let dev = Arc::new(MemDevice::from_vec(image));
    let (fs, report) = Fs::mount_report(dev.clone(), test_config()).unwrap();
    assert!(report.used_backup_superblock);
    assert!(fs.hitchhike_stats().active, "the image says version {VERSION}");
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/a").unwrap();
    f.write_at(b"after the torn upgrade", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    let sb = Superblock::decode(&dev.snapshot()[..4096]).expect("the primary is whole again");
    assert_eq!(sb.version, VERSION);
    assert!(sb.clean, "unmounted clean");
    fsck_clean(&*dev);
    let (fs, report) = Fs::mount_report(dev, test_config()).unwrap();
    assert!(!report.used_backup_superblock);
    assert_eq!(read_all(&fs, "/a"), b"after the torn upgrade");
}

#[test]
fn an_upgrade_interrupted_between_its_two_superblocks_is_finished_by_the_next_mount() {
    use pwfs::format::{Superblock, VERSION};
    let mut image = formatted_image(16 * MIB, &MkfsOptions::default());
    let backup = image.len() - 4096;
    let sb = Superblock::decode(&image[..4096]).unwrap();
    // The primary still says version 1 and not clean (the mount before had crashed);
    // the upgrade had written the backup.
    Superblock { version: 1, clean: false, ..sb.clone() }.encode(&mut image[..4096]);
    Superblock { version: VERSION, clean: false, ..sb }.encode(&mut image[backup..]);
    let dev = Arc::new(MemDevice::from_vec(image));
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert_eq!(r.errors, r.repairable, "only the unfinished upgrade: {:?}", r.errors);
    assert_eq!(r.errors.len(), 1);
    let (fs, report) = Fs::mount_report(dev.clone(), test_config()).unwrap();
    assert!(!report.used_backup_superblock);
    assert!(fs.hitchhike_stats().active);
    fs.write_file("/a", b"after").unwrap();
    fs.unmount().unwrap();
    let version = |at: usize| Superblock::decode(&dev.snapshot()[at..at + 4096]).unwrap().version;
    assert_eq!((version(0), version(backup)), (VERSION, VERSION));
    fsck_clean(&*dev);
}

#[test]
fn an_upgrade_torn_in_the_backup_superblock_is_finished_by_the_next_mount() {
    use pwfs::format::{Superblock, VERSION};
    let mut image = formatted_image(16 * MIB, &MkfsOptions::default());
    let backup = image.len() - 4096;
    let sb = Superblock::decode(&image[..4096]).unwrap();
    // A version-1 image not unmounted clean; the upgrade's write of the backup tore
    // (its first sector new, the rest old) and the primary was never written.
    let v1 = Superblock { version: 1, clean: false, ..sb.clone() };
    v1.encode(&mut image[..4096]);
    v1.encode(&mut image[backup..]);
    let mut v2 = vec![0u8; 4096];
    Superblock { version: VERSION, ..v1 }.encode(&mut v2);
    image[backup..backup + 512].copy_from_slice(&v2[..512]);
    assert!(Superblock::decode(&image[backup..]).is_err(), "a torn backup");
    let dev = Arc::new(MemDevice::from_vec(image));
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert_eq!(r.errors, r.repairable, "only the torn backup: {:?}", r.errors);
    let (fs, report) = Fs::mount_report(dev.clone(), test_config()).unwrap();
    assert!(!report.used_backup_superblock);
    fs.write_file("/a", b"after").unwrap();
    fs.unmount().unwrap();
    let version = |at: usize| Superblock::decode(&dev.snapshot()[at..at + 4096]).unwrap().version;
    assert_eq!((version(0), version(backup)), (VERSION, VERSION));
    fsck_clean(&*dev);
}

#[test]
fn a_version_1_image_is_upgraded_at_its_first_writable_mount() {
    use pwfs::format::{Superblock, VERSION};
    let mut image = formatted_image(16 * MIB, &MkfsOptions::default());
    let backup = image.len() - 4096;
    for at in [0, backup] {
        let mut sb = Superblock::decode(&image[at..at + 4096]).unwrap();
        sb.version = 1;
        sb.encode(&mut image[at..at + 4096]);
    }
    let version = |dev: &MemDevice, at: usize| Superblock::decode(&dev.snapshot()[at..at + 4096]).unwrap().version;
    let dev = Arc::new(MemDevice::from_vec(image));
    // Read-only: read as it is, nothing written, no hitchhiking.
    let fs = Fs::mount(dev.clone(), Config { read_only: true, ..test_config() }).unwrap();
    assert!(!fs.hitchhike_stats().active);
    drop(fs);
    assert_eq!((version(&dev, 0), version(&dev, backup)), (1, 1));
    // Writable: both superblocks say version 2 before anything else is written.
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert!(fs.hitchhike_stats().active);
    assert_eq!((version(&dev, 0), version(&dev, backup)), (VERSION, VERSION));
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/a").unwrap();
    f.write_at(b"after the upgrade", 0).unwrap();
    f.sync_all().unwrap();
    assert_eq!(fs.hitchhike_stats().hitchhiked, 1);
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    assert!(Superblock::decode(&dev.snapshot()[..4096]).unwrap().clean, "unmounted clean, as version 2");
}

/// A carried block zeroed (zero range) and rewritten before the transaction that
/// revokes it is durable, across many checkpoints (a 64-block journal): the rewrite
/// is never overwritten by the block's older logged contents.
#[test]
fn zeroed_and_rewritten_carried_blocks_survive_checkpoints() {
    let image = formatted_image(8 * MIB, &MkfsOptions { inodes: Some(1024), journal_blocks: Some(64) });
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(Stack::Async, true)).unwrap();
    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/z").unwrap();
    let mut points = Vec::new();
    let mut model = Vec::new();
    let mut in_sync = 0;
    for i in 0..80u64 {
        // A fresh block, carried by the fsync; then zeroed and rewritten whole.
        let at = i * 4096;
        f.write_at(&record(i, 64), at).unwrap();
        f.sync_all().unwrap();
        f.allocate(libc::FALLOC_FL_ZERO_RANGE as u32, at, 4096).unwrap();
        let v2 = noise(i, 4096);
        f.write_at(&v2, at).unwrap();
        // A bigger transaction than the fsyncs' (new directories): the checkpoints
        // fall in these commits, the ones that write the rewritten blocks in place.
        for d in 0..6 {
            fs.create_dir(format!("/d{i}-{d}"), 0o755).unwrap();
        }
        let c0 = fs.journal_stats().checkpoints;
        fs.sync().unwrap();
        in_sync += fs.journal_stats().checkpoints - c0;
        model.extend_from_slice(&v2);
        points.push((dev.log_len(), model.clone()));
    }
    assert!(in_sync > 3, "checkpoints in the rewriting commits: {in_sync}, {:?}", fs.journal_stats());
    drop(f);
    drop(fs);
    let log = dev.log();
    for (k, want) in &points {
        let fs =
            Fs::mount(Arc::new(MemDevice::from_vec(crash_image(&base, &log, *k, *k as u64))), test_config()).unwrap();
        assert_eq!(read_all(&fs, "/z"), *want, "crash after {k}");
    }
}

/// After a crash the new log starts one sequence number past the last transaction
/// replayed: a torn transaction may have left its whole commit block in the log (the
/// asynchronous stack writes it beside its body).
#[test]
fn a_mount_after_a_crash_starts_the_log_past_the_next_sequence_number() {
    use pwfs::format::{JournalHeader, Superblock};
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let base = dev.start_recording();
    let fs = Fs::mount(dev.clone(), config(Stack::Async, true)).unwrap();
    let syncs = appends(&fs, &dev, 5, 64, false);
    drop(fs);
    let img = crash_image(&base, &dev.log(), syncs.last().unwrap().0, 1);
    let sb = Superblock::decode(&img[..4096]).unwrap();
    let at = (sb.journal_start * 4096) as usize;
    let before = JournalHeader::decode(&img[at..at + 4096]).unwrap().start_seq;
    let dev = Arc::new(MemDevice::from_vec(img));
    let (fs, report) = Fs::mount_report(dev.clone(), test_config()).unwrap();
    assert!(report.transactions_replayed > 0);
    let after = JournalHeader::decode(&dev.snapshot()[at..at + 4096]).unwrap().start_seq;
    assert_eq!(after, before + report.transactions_replayed as u64 + 1);
    assert_eq!(read_all(&fs, "/log"), syncs.last().unwrap().1);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// One file's history in [`mixed_fsync_crash_points`]: its contents after each fsync
/// of it returned, with the device's log length then.
type History = Vec<(usize, Vec<u8>)>;

/// Small fsync'd changes of every kind to three files — appends, overwrites small and
/// whole-block, punches, zeroings, truncates down and up, each followed by an fsync or
/// fdatasync of its file — with the write-back thread aging the hitchhiking buffer
/// (carried blocks retire: written home, then revoked) and a small journal (many
/// checkpoints). At every crash point each file holds what its last fsync left or,
/// byte by byte, what the change in flight was making of it, and its size is one of
/// the two; a crash during recovery changes nothing of that.
fn mixed_fsync_crash_points(stack: Stack, seed: u64) {
    use pwfs::fs::{FALLOC_FL_KEEP_SIZE as KEEP, FALLOC_FL_PUNCH_HOLE as PUNCH, FALLOC_FL_ZERO_RANGE as ZERO};
    use rand::{Rng, SeedableRng};
    let image = formatted_image(16 * MIB, &MkfsOptions { inodes: Some(256), journal_blocks: Some(64) });
    let latency = if stack == Stack::Async { std::time::Duration::from_micros(10) } else { Default::default() };
    let dev = Arc::new(SimDevice::new(image, SimConfig { seed, latency, ..Default::default() }));
    let base = dev.start_recording();
    let cfg = Config { writeback_interval: Some(std::time::Duration::from_millis(3)), ..config(stack, true) };
    let fs = Fs::mount(dev.clone(), cfg).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let names = ["/a", "/b", "/c"];
    let files: Vec<pwfs::File> =
        names.iter().map(|n| OpenOptions::new().read(true).write(true).create(true).open(&fs, n).unwrap()).collect();
    fs.sync().unwrap();
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); 3];
    let mut history: Vec<History> = vec![vec![(dev.log_len(), Vec::new())]; 3];
    // What was done to each file, from which point of the log: named in a failure.
    let mut trace: Vec<Vec<(usize, String)>> = vec![Vec::new(); 3];
    for i in 0..240u64 {
        let which = rng.gen_range(0..3);
        let (f, m) = (&files[which], &mut model[which]);
        let len = m.len() as u64;
        let at = dev.log_len();
        let op = rng.gen_range(0..100);
        trace[which].push((at, format!("op {op} on {len} bytes")));
        match op {
            0..=34 => {
                let r = record(i, rng.gen_range(1..300));
                f.write_at(&r, len).unwrap();
                m.extend_from_slice(&r);
            }
            35..=59 if len > 0 => {
                let off = rng.gen_range(0..len) as usize;
                let r = record(i, rng.gen_range(1..200).min(m.len() - off));
                f.write_at(&r, off as u64).unwrap();
                m[off..off + r.len()].copy_from_slice(&r);
            }
            60..=67 => {
                // A whole block that does not compress: logged or written whole.
                let at = rng.gen_range(0..=len / 4096) as usize * 4096;
                let r = noise(i, 4096);
                f.write_at(&r, at as u64).unwrap();
                if m.len() < at + 4096 {
                    m.resize(at + 4096, 0);
                }
                m[at..at + 4096].copy_from_slice(&r);
            }
            68..=77 if len > 0 => {
                let off = rng.gen_range(0..len);
                let n = rng.gen_range(1..12_000);
                let mode = if rng.gen_bool(0.5) { PUNCH | KEEP } else { ZERO | KEEP };
                f.allocate(mode, off, n).unwrap();
                trace[which].last_mut().unwrap().1 +=
                    &format!(": {} {off}+{n}", if mode & PUNCH != 0 { "punch" } else { "zero" });
                let end = (off + n).min(len) as usize;
                m[off as usize..end].fill(0);
            }
            78..=89 => {
                let size = if rng.gen_bool(0.7) { rng.gen_range(0..=len) } else { len + rng.gen_range(1..6000) };
                f.set_len(size).unwrap();
                m.resize(size as usize, 0);
            }
            _ => {
                // Let the write-back thread age the buffer (retirements).
                std::thread::sleep(std::time::Duration::from_millis(8));
                continue;
            }
        }
        if rng.gen_bool(0.5) {
            f.sync_all().unwrap();
            trace[which].last_mut().unwrap().1 += ", fsync";
        } else {
            f.sync_data().unwrap();
            trace[which].last_mut().unwrap().1 += ", fdatasync";
        }
        history[which].push((dev.log_len(), m.clone()));
    }
    let hh = fs.hitchhike_stats();
    assert!(hh.hitchhiked > 50 && hh.retired > 0, "seed {seed}: the paths under test did not run: {hh:?}");
    drop(files);
    drop(fs);
    let log = dev.log();
    // From the moment the three files exist.
    let start = history[0][0].0;
    let step = ((log.len() - start) / 50).max(1);
    let mut checked = 0;
    for k in (start..=log.len()).step_by(step).chain([log.len()]) {
        let ctx = format!("{stack:?} seed {seed}: crash at {k} of {}", log.len());
        for (which, img) in crash_images(&base, &log, k, seed ^ k as u64, k * 13 + seed as usize, &ctx) {
            let dev = Arc::new(MemDevice::from_vec(img));
            let fs = Fs::mount(dev.clone(), test_config()).unwrap_or_else(|e| panic!("{ctx}: {which}: {e}"));
            for ((n, h), t) in names.iter().zip(&history).zip(&trace) {
                let i = h.iter().rposition(|(at, _)| *at <= k).unwrap();
                let done: Vec<&(usize, String)> = t.iter().filter(|(at, _)| *at <= k).collect();
                let ops = &done[done.len().saturating_sub(3)..];
                let low = &h[i].1;
                let high = &h.get(i + 1).unwrap_or(&h[i]).1;
                let got = read_all(&fs, n);
                assert!(
                    got.len() == low.len() || got.len() == high.len(),
                    "{ctx}: {which}: {n} has {} bytes, fsync'd {} (next {})",
                    got.len(),
                    low.len(),
                    high.len()
                );
                for (j, b) in got.iter().enumerate() {
                    // Past both, a size raised by the change reads zeros.
                    let either = low.get(j).copied().unwrap_or(0) == *b || high.get(j).copied().unwrap_or(0) == *b;
                    assert!(
                        either,
                        "{ctx}: {which}: {n} byte {j} is {b:#04x}: neither fsync'd ({:?}) nor being written ({:?}); \
                         sizes {} / {}; last changes {ops:?}",
                        low.get(j),
                        high.get(j),
                        low.len(),
                        high.len()
                    );
                }
            }
            fs.unmount().unwrap();
            fsck_clean(&*dev);
            checked += 1;
        }
    }
    assert!(checked > 20);
}

#[test]
fn crash_points_of_mixed_fsyncd_changes_async_stack() {
    mixed_fsync_crash_points(Stack::Async, 1);
}

#[test]
fn crash_points_of_mixed_fsyncd_changes_sync_stack() {
    mixed_fsync_crash_points(Stack::Sync, 2);
}

/// More seeds of [`mixed_fsync_crash_points`] on request, both stacks:
/// `PWFS_HH_SEEDS=100 cargo test --release --test hitchhike -- --ignored` runs 100..110.
#[test]
#[ignore = "long: more seeds on request"]
fn crash_points_of_mixed_fsyncd_changes_env_seeds() {
    let start: u64 = std::env::var("PWFS_HH_SEEDS").map_or(1000, |s| s.parse().unwrap());
    for seed in start..start + 10 {
        mixed_fsync_crash_points(if seed % 2 == 0 { Stack::Async } else { Stack::Sync }, seed);
    }
}

/// Carried blocks zeroed (zero range) and not written again leave the buffer once
/// the commit that revokes them is durable: they stayed until the next checkpoint,
/// each taking a place of the buffer (hitchhiking stopped once it was full).
#[test]
fn zeroed_carried_blocks_leave_the_buffer_after_their_revoke_commits() {
    let image = formatted_image(64 * MIB, &MkfsOptions::default());
    let dev = Arc::new(MemDevice::from_vec(image));
    let fs = Fs::mount(dev.clone(), config(Stack::Sync, true)).unwrap();
    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/z").unwrap();
    f.write_at(&vec![1u8; 12 * 4096], 0).unwrap();
    f.sync_all().unwrap();
    let checkpoints = fs.journal_stats().checkpoints;
    for i in 0..12u64 {
        f.write_at(&record(i, 64), i * 4096).unwrap();
        f.sync_all().unwrap();
    }
    let carried = fs.hitchhike_stats().buffered;
    assert!(carried >= 10, "the small fsyncs were carried: {:?}", fs.hitchhike_stats());
    f.allocate(libc::FALLOC_FL_ZERO_RANGE as u32, 0, 12 * 4096).unwrap();
    f.sync_all().unwrap();
    assert_eq!(fs.journal_stats().checkpoints, checkpoints, "no checkpoint emptied the buffer");
    assert_eq!(fs.hitchhike_stats().buffered, 0, "{:?}", fs.hitchhike_stats());
    assert!(read_all(&fs, "/z").iter().all(|b| *b == 0));
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev, test_config()).unwrap();
    assert!(read_all(&fs, "/z").iter().all(|b| *b == 0));
}
