//! Namespace and file semantics through the Rust API, with exact errno values.

mod common;
use common::*;
use pwfs::{FileType, OpenOptions, TimeSet};

#[test]
fn files_read_write_sparse_and_truncate() {
    let (dev, fs) = mem_fs(64 * MIB);
    let f = fs.create("/a").unwrap();
    f.write_at(b"hello", 0).unwrap();
    f.write_at(b"world", 10_000).unwrap();
    let mut buf = vec![0xaa; 10_005];
    let r = OpenOptions::new().read(true).open(&fs, "/a").unwrap();
    assert_eq!(r.read_at(&mut buf, 0).unwrap(), 10_005);
    assert_eq!(&buf[..5], b"hello");
    assert!(buf[5..10_000].iter().all(|b| *b == 0), "hole reads as zeros");
    assert_eq!(&buf[10_000..], b"world");
    assert_eq!(r.read_at(&mut buf, 10_005).unwrap(), 0, "EOF");
    f.set_len(3).unwrap();
    assert_eq!(fs.read_file("/a").unwrap(), b"hel");
    f.set_len(5000).unwrap();
    let data = fs.read_file("/a").unwrap();
    assert_eq!(data.len(), 5000);
    assert_eq!(&data[..3], b"hel");
    assert!(data[3..].iter().all(|b| *b == 0), "truncate down then up exposes zeros");
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    let data = fs.read_file("/a").unwrap();
    assert!(data[3..].iter().all(|b| *b == 0), "also after the cache is dropped");
    // Large write spanning many pages, read back cold.
    let big: Vec<u8> = (0..3 * MIB as usize + 123).map(|i| (i * 7 % 251) as u8).collect();
    fs.write_file("/big", &big).unwrap();
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    assert_eq!(fs.read_file("/big").unwrap(), big);
    drop((f, r));
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn open_flags() {
    let (_dev, fs) = mem_fs(16 * MIB);
    assert_eq!(errno(OpenOptions::new().read(true).open(&fs, "/nope")), libc::ENOENT);
    let f = OpenOptions::new().write(true).create_new(true).open(&fs, "/x").unwrap();
    f.write_at(b"abc", 0).unwrap();
    assert_eq!(errno(OpenOptions::new().write(true).create_new(true).open(&fs, "/x")), libc::EEXIST);
    let a = OpenOptions::new().append(true).open(&fs, "/x").unwrap();
    a.write(b"def").unwrap();
    a.write_at(b"ghi", 0).unwrap();
    assert_eq!(fs.read_file("/x").unwrap(), b"abcdefghi", "O_APPEND writes at the end");
    OpenOptions::new().write(true).truncate(true).open(&fs, "/x").unwrap();
    assert_eq!(fs.metadata("/x").unwrap().size, 0);
    assert_eq!(errno(OpenOptions::new().read(true).open(&fs, "/x/y")), libc::ENOTDIR);
    fs.create_dir("/d", 0o755).unwrap();
    assert_eq!(errno(OpenOptions::new().write(true).open(&fs, "/d")), libc::EISDIR);
    let ro = OpenOptions::new().read(true).open(&fs, "/x").unwrap();
    assert_eq!(errno(ro.write_at(b"z", 0)), libc::EBADF);
    assert_eq!(errno(fs.read_file("/d")), libc::EISDIR);
    // As open(2) on Linux: O_RDONLY with O_CREAT creates, with O_TRUNC truncates; the
    // handle stays read-only. Either on a directory is EISDIR.
    let made = OpenOptions::new().read(true).create(true).mode(0o600).open(&fs, "/r").unwrap();
    assert_eq!(fs.metadata("/r").unwrap().mode & 0o7777, 0o600);
    assert_eq!(errno(made.write_at(b"z", 0)), libc::EBADF);
    fs.write_file("/t", b"contents").unwrap();
    let t = OpenOptions::new().read(true).truncate(true).open(&fs, "/t").unwrap();
    assert_eq!(fs.metadata("/t").unwrap().size, 0);
    assert_eq!(errno(t.write_at(b"z", 0)), libc::EBADF);
    assert_eq!(errno(OpenOptions::new().read(true).truncate(true).open(&fs, "/d")), libc::EISDIR);
    assert_eq!(errno(OpenOptions::new().read(true).create(true).open(&fs, "/d")), libc::EISDIR);
}

#[test]
fn directories_and_errnos() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    assert_eq!(errno(fs.create_dir("/d", 0o755)), libc::EEXIST);
    assert_eq!(errno(fs.create_dir("/", 0o755)), libc::EEXIST);
    assert_eq!(errno(fs.create_dir("/nope/d", 0o755)), libc::ENOENT);
    fs.write_file("/d/f", b"x").unwrap();
    assert_eq!(errno(fs.remove_dir("/d")), libc::ENOTEMPTY);
    assert_eq!(errno(fs.remove_dir("/d/f")), libc::ENOTDIR);
    assert_eq!(errno(fs.remove_file("/d")), libc::EISDIR);
    assert_eq!(errno(fs.remove_dir("/d/.")), libc::EINVAL);
    // As Linux: unlink of "." or ".." is EISDIR, mknod of a directory EPERM.
    let d = fs.metadata("/d").unwrap().ino;
    assert_eq!(errno(fs.unlink(d, b".")), libc::EISDIR);
    assert_eq!(errno(fs.unlink(d, b"..")), libc::EISDIR);
    assert_eq!(errno(fs.mknod(d, b"m", 0o040755, 0, &pwfs::Creator::new(0, 0))), libc::EPERM);
    assert_eq!(errno(fs.mknod(d, b"m", 0o120777, 0, &pwfs::Creator::new(0, 0))), libc::EINVAL);
    assert_eq!(errno(fs.create_dir("/d/f/g", 0o755)), libc::ENOTDIR);
    let long = "n".repeat(256);
    assert_eq!(errno(fs.create(format!("/{long}"))), libc::ENAMETOOLONG);
    fs.create(format!("/{}", "n".repeat(255))).unwrap();
    assert_eq!(fs.metadata("/").unwrap().nlink, 3);
    assert_eq!(fs.metadata("/d").unwrap().nlink, 2);
    fs.create_dir("/d/sub", 0o700).unwrap();
    assert_eq!(fs.metadata("/d").unwrap().nlink, 3);
    assert_eq!(fs.metadata("/d/sub/..").unwrap().ino, fs.metadata("/d").unwrap().ino);
    fs.remove_file("/d/f").unwrap();
    fs.remove_dir("/d/sub").unwrap();
    fs.remove_dir("/d").unwrap();
    assert_eq!(errno(fs.metadata("/d")), libc::ENOENT);
    assert_eq!(fs.metadata("/").unwrap().nlink, 2);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn rename_cases() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.create_dir("/a", 0o755).unwrap();
    fs.create_dir("/a/b", 0o755).unwrap();
    fs.write_file("/f", b"1").unwrap();
    fs.write_file("/g", b"2").unwrap();
    assert_eq!(errno(fs.rename_path("/a", "/a/b/c")), libc::EINVAL);
    assert_eq!(errno(fs.rename_path("/a", "/a/b")), libc::EINVAL);
    assert_eq!(errno(fs.rename_path("/nope", "/x")), libc::ENOENT);
    fs.rename_path("/f", "/g").unwrap();
    assert_eq!(fs.read_file("/g").unwrap(), b"1");
    assert_eq!(errno(fs.metadata("/f")), libc::ENOENT);
    assert_eq!(errno(fs.rename_path("/g", "/a")), libc::EISDIR);
    assert_eq!(errno(fs.rename_path("/a", "/g")), libc::ENOTDIR);
    fs.create_dir("/e", 0o755).unwrap();
    assert_eq!(errno(fs.rename_path("/e", "/a")), libc::ENOTEMPTY);
    fs.rename_path("/a/b", "/e/b").unwrap();
    fs.rename_path("/e", "/a").unwrap();
    assert_eq!(fs.metadata("/a/b/..").unwrap().ino, fs.metadata("/a").unwrap().ino);
    assert_eq!(fs.metadata("/a").unwrap().nlink, 3);
    fs.hard_link("/g", "/a/h").unwrap();
    assert_eq!(fs.metadata("/g").unwrap().nlink, 2);
    fs.rename_path("/g", "/a/h").unwrap(); // same inode: nothing happens
    assert_eq!(fs.metadata("/g").unwrap().nlink, 2);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn links_symlinks_and_attributes() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.write_file("/f", b"data").unwrap();
    fs.hard_link("/f", "/l").unwrap();
    assert_eq!(fs.metadata("/l").unwrap().ino, fs.metadata("/f").unwrap().ino);
    assert_eq!(errno(fs.hard_link("/", "/r")), libc::EPERM);
    assert_eq!(errno(fs.hard_link("/f", "/l")), libc::EEXIST);
    fs.symlink_path("f", "/s").unwrap();
    let long_target = "x/".repeat(1000) + "f";
    fs.symlink_path(&long_target, "/s2").unwrap();
    assert_eq!(fs.read_link("/s2").unwrap(), long_target.as_bytes());
    assert_eq!(fs.read_link("/s").unwrap(), b"f");
    assert_eq!(fs.read_file("/s").unwrap(), b"data");
    assert_eq!(fs.symlink_metadata("/s").unwrap().kind, FileType::Symlink);
    fs.symlink_path("/loop", "/loop").unwrap();
    assert_eq!(errno(fs.metadata("/loop")), libc::ELOOP);
    assert_eq!(errno(OpenOptions::new().read(true).nofollow(true).open(&fs, "/s")), libc::ELOOP);
    let md = fs.set_permissions("/f", 0o600).unwrap();
    assert_eq!(md.mode, 0o100600);
    let md = fs.set_owner("/f", Some(7), Some(8)).unwrap();
    assert_eq!((md.uid, md.gid), (7, 8));
    let t = pwfs::format::Timespec { sec: 1_000_000, nsec: 123_456_789 };
    let md = fs.set_times("/f", Some(TimeSet::At(t)), Some(TimeSet::At(t))).unwrap();
    assert_eq!((md.atime, md.mtime), (t, t));
    assert!(md.ctime.sec > 1_000_000);
    fs.remove_file("/f").unwrap();
    assert_eq!(fs.read_file("/l").unwrap(), b"data");
    assert_eq!(fs.metadata("/l").unwrap().nlink, 1);
    let st = fs.statfs();
    assert!(st.blocks_available > 0 && st.inodes_free > 0 && st.name_max == 255);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn unlinked_open_file_lives_until_close() {
    let (dev, fs) = mem_fs(16 * MIB);
    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/t").unwrap();
    f.write_at(&vec![5u8; 100_000], 0).unwrap();
    fs.remove_file("/t").unwrap();
    assert_eq!(errno(fs.metadata("/t")), libc::ENOENT);
    fs.sync().unwrap();
    let mut buf = vec![0; 100_000];
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), 100_000);
    assert!(buf.iter().all(|b| *b == 5));
    let free_before = fs.statfs().blocks_free;
    drop(f);
    fs.sync().unwrap();
    assert!(fs.statfs().blocks_free > free_before, "blocks come back after the last close");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn readdir_offsets_are_stable() {
    let (_dev, fs) = mem_fs(16 * MIB);
    for i in 0..100 {
        fs.write_file(format!("/f{i}"), b"").unwrap();
    }
    let root = fs.metadata("/").unwrap().ino;
    let first = fs.readdir(root, 0, 40).unwrap();
    assert_eq!(first[0].name, b".");
    assert_eq!(first[1].name, b"..");
    // Changes elsewhere in the directory do not move the entries after the cursor.
    fs.remove_file("/f0").unwrap();
    fs.write_file("/new", b"").unwrap();
    let rest = fs.readdir(root, first.last().unwrap().next, usize::MAX).unwrap();
    let mut names: Vec<Vec<u8>> = first.iter().chain(&rest).map(|e| e.name.clone()).collect();
    names.retain(|n| n != b"new" && n != b"." && n != b"..");
    names.sort();
    let mut want: Vec<Vec<u8>> = (0..100).map(|i| format!("f{i}").into_bytes()).collect();
    want.sort();
    assert_eq!(names, want, "every entry present before the change is seen exactly once");
}

/// With the write-back thread on and a tiny cache, writers are throttled while it
/// writes back; nothing is lost and nothing deadlocks.
#[test]
fn background_writeback_under_pressure() {
    let dev = std::sync::Arc::new(pwfs::device::mem::MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
    let config = pwfs::Config {
        cache_bytes: 64 * 4096,
        writeback_interval: Some(std::time::Duration::from_millis(50)),
        ..Default::default()
    };
    let fs = pwfs::Fs::mount(dev.clone(), config.clone()).unwrap();
    let threads: Vec<_> = (0..3u8)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let f = fs.create(format!("/w{t}")).unwrap();
                for i in 0..64u64 {
                    f.write_at(&vec![t.wrapping_mul(31).wrapping_add(i as u8); 65536], i * 65536).unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|h| h.join().unwrap());
    fs.unmount().unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), config).unwrap();
    for t in 0..3u8 {
        let data = fs.read_file(format!("/w{t}")).unwrap();
        assert_eq!(data.len(), 64 * 65536);
        for (i, chunk) in data.chunks(65536).enumerate() {
            assert!(chunk.iter().all(|b| *b == t.wrapping_mul(31).wrapping_add(i as u8)), "file {t} chunk {i}");
        }
    }
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn extended_attributes() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.write_file("/f", b"x").unwrap();
    let ino = fs.metadata("/f").unwrap().ino;
    let blocks = fs.getattr(ino).unwrap().blocks;
    fs.setxattr(ino, b"user.a", b"1", false, false).unwrap();
    fs.setxattr(ino, b"user.b", &[9u8; 2000], false, false).unwrap();
    assert_eq!(fs.getxattr(ino, b"user.a").unwrap(), b"1");
    assert_eq!(errno(fs.getxattr(ino, b"user.zz")), libc::ENODATA);
    assert_eq!(errno(fs.setxattr(ino, b"user.a", b"2", true, false)), libc::EEXIST);
    assert_eq!(errno(fs.setxattr(ino, b"user.q", b"2", false, true)), libc::ENODATA);
    assert_eq!(errno(fs.setxattr(ino, b"other.a", b"2", false, false)), libc::EOPNOTSUPP);
    // A namespace with nothing after it: EINVAL, as ext4 (the kernel's xattr_resolve_name).
    assert_eq!(errno(fs.setxattr(ino, b"user.", b"2", false, false)), libc::EINVAL);
    assert_eq!(errno(fs.getxattr(ino, b"trusted.")), libc::EINVAL);
    assert_eq!(errno(fs.setxattr(ino, b"user.c", &[0u8; 65537], false, false)), libc::E2BIG, "at most 64 KiB");
    assert!(fs.getattr(ino).unwrap().blocks > blocks, "the attribute block is counted");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.listxattr(ino).unwrap(), vec![b"user.a".to_vec(), b"user.b".to_vec()], "durable, sorted");
    fs.removexattr(ino, b"user.a").unwrap();
    fs.removexattr(ino, b"user.b").unwrap();
    assert_eq!(errno(fs.removexattr(ino, b"user.b")), libc::ENODATA);
    assert!(fs.listxattr(ino).unwrap().is_empty());
    fs.setxattr(ino, b"user.z", b"v", false, false).unwrap();
    fs.remove_file("/f").unwrap();
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn rename_exchange_swaps_files_and_directories_atomically() {
    let (dev, fs) = mem_fs(32 * MIB);
    let root = 1;
    fs.write_file("/a", b"aaa").unwrap();
    fs.create_dir("/d1", 0o755).unwrap();
    fs.create_dir("/d2", 0o755).unwrap();
    fs.create_dir("/d1/sub", 0o755).unwrap();
    fs.write_file("/d2/b", b"bbb").unwrap();
    let (d1, d2) = (fs.metadata("/d1").unwrap().ino, fs.metadata("/d2").unwrap().ino);
    // Two files: contents swap, inode numbers with them.
    let (ia, ib) = (fs.metadata("/a").unwrap().ino, fs.metadata("/d2/b").unwrap().ino);
    fs.rename_exchange(root, b"a", d2, b"b").unwrap();
    assert_eq!(fs.read_file("/a").unwrap(), b"bbb");
    assert_eq!(fs.read_file("/d2/b").unwrap(), b"aaa");
    assert_eq!((fs.metadata("/a").unwrap().ino, fs.metadata("/d2/b").unwrap().ino), (ib, ia));
    // A directory with a file across parents: link counts and '..' follow.
    let (n1, n2) = (fs.metadata("/d1").unwrap().nlink, fs.metadata("/d2").unwrap().nlink);
    fs.rename_exchange(d1, b"sub", d2, b"b").unwrap();
    assert!(fs.metadata("/d2/b").unwrap().is_dir());
    assert_eq!(fs.read_file("/d1/sub").unwrap(), b"aaa");
    assert_eq!(fs.metadata("/d1").unwrap().nlink, n1 - 1);
    assert_eq!(fs.metadata("/d2").unwrap().nlink, n2 + 1);
    fs.write_file("/d2/b/x", b"x").unwrap();
    assert_eq!(fs.read_file("/d2/b/../b/x").unwrap(), b"x");
    // Errors: a missing name, a directory into itself, '.'.
    assert_eq!(errno(fs.rename_exchange(root, b"nope", d2, b"b")), libc::ENOENT);
    assert_eq!(errno(fs.rename_exchange(d2, b"b", d2, b"nope")), libc::ENOENT);
    let sub = fs.metadata("/d2/b").unwrap().ino;
    fs.create_dir("/d2/b/in", 0o755).unwrap();
    assert_eq!(errno(fs.rename_exchange(root, b"d2", sub, b"in")), libc::EINVAL);
    assert_eq!(errno(fs.rename_exchange(root, b".", d2, b"b")), libc::EBUSY);
    // The same inode under both names: nothing happens.
    fs.rename_exchange(d2, b"b", d2, b"b").unwrap();
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn rename_whiteout_leaves_a_whiteout_device_in_the_source_name() {
    let (dev, fs) = mem_fs(32 * MIB);
    fs.write_file("/upper", b"u").unwrap();
    fs.write_file("/taken", b"t").unwrap();
    fs.rename_whiteout(1, b"upper", 1, b"moved", false, (7, 8)).unwrap();
    assert_eq!(fs.read_file("/moved").unwrap(), b"u");
    let w = fs.metadata("/upper").unwrap();
    assert_eq!(w.mode & 0o170000, 0o020000, "a character device");
    assert_eq!((w.rdev, w.uid, w.gid, w.nlink), (0, 7, 8, 1));
    assert_eq!(errno(fs.rename_whiteout(1, b"moved", 1, b"taken", true, (0, 0))), libc::EEXIST);
    fs.rename_whiteout(1, b"moved", 1, b"taken", false, (0, 0)).unwrap();
    assert_eq!(fs.read_file("/taken").unwrap(), b"u");
    // In a set-group-ID directory the whiteout takes the directory's group.
    let d = fs.create_dir("/sg", 0o777).unwrap().ino;
    fs.setattr(d, &pwfs::SetAttr { mode: Some(0o2777), gid: Some(50), ..Default::default() }).unwrap();
    fs.write_file("/sg/x", b"x").unwrap();
    fs.rename_whiteout(d, b"x", d, b"y", false, (7, 8)).unwrap();
    assert_eq!(fs.metadata("/sg/x").unwrap().gid, 50);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn immutable_and_append_only_flags_are_kept_and_enforced() {
    use pwfs::fs::{FS_APPEND_FL, FS_IMMUTABLE_FL, FS_NOATIME_FL};
    use pwfs::SetAttr;
    let (dev, fs) = mem_fs(32 * MIB);
    fs.write_file("/i", b"fixed").unwrap();
    fs.write_file("/a", b"log:").unwrap();
    fs.create_dir("/d", 0o755).unwrap();
    let (i, a, d) = (fs.metadata("/i").unwrap().ino, fs.metadata("/a").unwrap().ino, fs.metadata("/d").unwrap().ino);
    assert_eq!(fs.get_flags(i).unwrap(), 0);
    assert_eq!(errno(fs.set_flags(i, 0x4000)), libc::EOPNOTSUPP, "a flag Patchwork does not keep");
    fs.set_flags(i, FS_IMMUTABLE_FL | FS_NOATIME_FL).unwrap();
    fs.set_flags(a, FS_APPEND_FL).unwrap();
    // Immutable: no write, truncate, chmod, link, unlink, rename, xattr, fallocate.
    let eperm = libc::EPERM;
    assert_eq!(errno(fs.write(i, 0, b"x", false)), eperm);
    assert_eq!(errno(fs.truncate(i, 0)), eperm);
    assert_eq!(errno(fs.setattr(i, &SetAttr { mode: Some(0o600), ..Default::default() })), eperm);
    assert_eq!(errno(fs.link(i, 1, b"i2")), eperm);
    assert_eq!(errno(fs.unlink(1, b"i")), eperm);
    assert_eq!(errno(fs.rename(1, b"i", 1, b"j", false)), eperm);
    assert_eq!(errno(fs.setxattr(i, b"user.x", b"1", false, false)), eperm);
    assert_eq!(errno(fs.fallocate(i, 0, 0, 4096)), eperm);
    // Append-only: writes at the end only; no truncate, unlink or rename; preallocation is fine.
    fs.write(a, 4, b"one", false).unwrap();
    fs.write(a, 0, b"two", true).unwrap();
    assert_eq!(errno(fs.write(a, 0, b"XX", false)), eperm);
    assert_eq!(errno(fs.truncate(a, 1)), eperm);
    assert_eq!(errno(fs.unlink(1, b"a")), eperm);
    assert_eq!(errno(fs.fallocate(a, pwfs::fs::FALLOC_FL_PUNCH_HOLE | pwfs::fs::FALLOC_FL_KEEP_SIZE, 0, 1)), eperm);
    fs.fallocate(a, pwfs::fs::FALLOC_FL_KEEP_SIZE, 0, 8192).unwrap();
    assert_eq!(fs.read_file("/a").unwrap(), b"log:onetwo");
    // Opens, as may_open: write access to an append-only file only with O_APPEND, and
    // no O_TRUNC; none to an immutable one. Reading is fine.
    let open = |path: &str, write: bool, append: bool, truncate: bool| {
        OpenOptions::new().read(true).write(write).append(append).truncate(truncate).open(&fs, path).map(drop)
    };
    assert_eq!(errno(open("/a", true, false, false)), eperm, "write without O_APPEND");
    assert_eq!(errno(open("/a", true, true, true)), eperm, "O_TRUNC");
    open("/a", true, true, false).unwrap();
    open("/a", false, false, false).unwrap();
    assert_eq!(errno(open("/i", true, false, false)), eperm, "immutable");
    open("/i", false, false, false).unwrap();
    assert_eq!(errno(fs.open_ino_file(a, true, true, false).map(drop)), eperm, "by number too");
    fs.open_ino_file(a, true, true, true).unwrap();
    // An append-only directory takes new names, but loses none, not even to a rename
    // onto one of them.
    fs.create_dir("/ad", 0o755).unwrap();
    fs.write_file("/ad/old", b"").unwrap();
    fs.write_file("/x", b"").unwrap();
    let ad = fs.metadata("/ad").unwrap().ino;
    fs.set_flags(ad, FS_APPEND_FL).unwrap();
    assert_eq!(errno(fs.rename(1, b"x", ad, b"old", false)), eperm);
    assert_eq!(errno(fs.unlink(ad, b"old")), eperm);
    fs.rename(1, b"x", ad, b"new", false).unwrap();
    fs.set_flags(ad, 0).unwrap();
    // An immutable directory takes no new names and loses none.
    fs.write_file("/d/in", b"").unwrap();
    fs.set_flags(d, FS_IMMUTABLE_FL).unwrap();
    assert_eq!(errno(fs.create("/d/new")), eperm);
    assert_eq!(errno(fs.remove_file("/d/in")), eperm);
    // The flags are checked before emptiness (Linux's may_delete): a full immutable
    // directory, or one in an append-only parent, is EPERM to rmdir, not ENOTEMPTY.
    assert_eq!(errno(fs.rmdir(1, b"d")), eperm);
    fs.create_dir("/ap", 0o755).unwrap();
    fs.create_dir("/ap/full", 0o755).unwrap();
    fs.write_file("/ap/full/x", b"").unwrap();
    let ap = fs.metadata("/ap").unwrap().ino;
    fs.set_flags(ap, FS_APPEND_FL).unwrap();
    assert_eq!(errno(fs.rmdir(ap, b"full")), eperm);
    fs.set_flags(ap, 0).unwrap();
    assert_eq!(errno(fs.rmdir(ap, b"full")), libc::ENOTEMPTY);
    // So does a rename over it.
    fs.create_dir("/src", 0o755).unwrap();
    let full = fs.metadata("/ap/full").unwrap().ino;
    fs.set_flags(full, FS_IMMUTABLE_FL).unwrap();
    assert_eq!(errno(fs.rename(1, b"src", ap, b"full", false)), eperm);
    fs.set_flags(full, 0).unwrap();
    assert_eq!(errno(fs.rename(1, b"src", ap, b"full", false)), libc::ENOTEMPTY);
    // The flags survive a remount; cleared, everything is allowed again.
    fs.unmount().unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.get_flags(i).unwrap(), FS_IMMUTABLE_FL | FS_NOATIME_FL);
    assert_eq!(fs.get_flags(a).unwrap(), FS_APPEND_FL);
    for ino in [i, a, d] {
        fs.set_flags(ino, 0).unwrap();
    }
    fs.unlink(1, b"i").unwrap();
    fs.truncate(a, 0).unwrap();
    fs.remove_file("/d/in").unwrap();
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn access_times_follow_the_relatime_rule_when_asked_for() {
    use pwfs::{SetAttr, TimeSet};
    let dev = std::sync::Arc::new(pwfs::device::mem::MemDevice::new(32 * MIB));
    pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), pwfs::Config { atime: true, ..test_config() }).unwrap();
    fs.write_file("/f", b"data").unwrap();
    let ino = fs.metadata("/f").unwrap().ino;
    let old = pwfs::format::Timespec { sec: 1_000_000, nsec: 0 };
    let past = SetAttr { atime: Some(TimeSet::At(old)), mtime: Some(TimeSet::At(old)), ..Default::default() };
    fs.setattr(ino, &past).unwrap();
    let mut buf = [0u8; 4];
    // A day old: a read moves it.
    fs.read(ino, 0, &mut buf).unwrap();
    let a1 = fs.getattr(ino).unwrap().atime;
    assert!(a1.sec > old.sec, "the read did not update a day-old access time");
    // After the modification and the change time, and fresh: a read leaves it.
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs.read(ino, 0, &mut buf).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().atime, a1, "relatime updated a fresh access time");
    // A write makes it stale again.
    fs.write(ino, 0, b"more", false).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs.read(ino, 0, &mut buf).unwrap();
    let a2 = fs.getattr(ino).unwrap().atime;
    assert!((a2.sec, a2.nsec) > (a1.sec, a1.nsec), "a read after a write did not update the access time");
    // The noatime flag keeps it, and it is durable.
    fs.setattr(ino, &past).unwrap();
    fs.set_flags(ino, pwfs::fs::FS_NOATIME_FL).unwrap();
    fs.read(ino, 0, &mut buf).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().atime, old);
    fs.set_flags(ino, 0).unwrap();
    fs.read(ino, 0, &mut buf).unwrap();
    let a3 = fs.getattr(ino).unwrap().atime;
    fs.unmount().unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().atime, a3, "the access time is stored");
    // Without Config::atime (the default, noatime) reads change nothing.
    fs.setattr(ino, &past).unwrap();
    fs.read(ino, 0, &mut buf).unwrap();
    assert_eq!(fs.getattr(ino).unwrap().atime, old);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn extended_attributes_up_to_64_kib_each_and_many_per_inode() {
    let (dev, fs) = mem_fs(32 * MIB);
    fs.write_file("/x", b"").unwrap();
    let ino = fs.metadata("/x").unwrap().ino;
    let free = fs.statfs().blocks_free;
    let big = |i: u8| (0..65536u32).map(|k| (k as u8) ^ i).collect::<Vec<u8>>();
    for i in 0..3u8 {
        fs.setxattr(ino, format!("user.big{i}").as_bytes(), &big(i), false, false).unwrap();
    }
    for i in 0..200u32 {
        fs.setxattr(ino, format!("user.small{i:03}").as_bytes(), &i.to_le_bytes(), false, false).unwrap();
    }
    assert_eq!(errno(fs.setxattr(ino, b"user.huge", &vec![0u8; 65537], false, false)), libc::E2BIG);
    let md = fs.getattr(ino).unwrap();
    assert!(md.blocks >= 48 * 8, "{} sectors for ~200 KiB of attributes", md.blocks);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    for i in 0..3u8 {
        assert_eq!(fs.getxattr(ino, format!("user.big{i}").as_bytes()).unwrap(), big(i));
    }
    assert_eq!(fs.getxattr(ino, b"user.small123").unwrap(), 123u32.to_le_bytes());
    assert_eq!(fs.listxattr(ino).unwrap().len(), 203);
    // More than an inode may hold: ENOSPC, nothing changed.
    assert_eq!(errno(fs.setxattr(ino, b"user.big3", &big(3), false, false)), libc::ENOSPC);
    assert_eq!(fs.listxattr(ino).unwrap().len(), 203);
    // Shrinking frees the blocks again.
    for i in 0..3u8 {
        fs.removexattr(ino, format!("user.big{i}").as_bytes()).unwrap();
    }
    for i in 0..200u32 {
        fs.removexattr(ino, format!("user.small{i:03}").as_bytes()).unwrap();
    }
    fs.sync().unwrap();
    assert_eq!(fs.statfs().blocks_free, free, "every attribute block is free again");
    fs.setxattr(ino, b"user.again", b"1", false, false).unwrap();
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn tmpfiles_have_no_name_until_linked_and_vanish_otherwise() {
    use pwfs::Creator;
    let (dev, fs) = mem_fs(32 * MIB);
    let who = Creator::new(0, 0);
    let inodes = fs.statfs().inodes_free;
    // Linked: it gets a name, keeps its data, and the directory never listed it before.
    let t = fs.tmpfile(1, 0o640, &who, true).unwrap();
    assert_eq!((t.nlink, t.mode & 0o7777), (0, 0o640));
    assert!(fs.read_dir("/").unwrap().iter().all(|e| e.ino != t.ino));
    fs.write(t.ino, 0, b"staged", false).unwrap();
    fs.link(t.ino, 1, b"published").unwrap();
    fs.release_ino(t.ino);
    assert_eq!(fs.read_file("/published").unwrap(), b"staged");
    assert_eq!(fs.metadata("/published").unwrap().nlink, 1);
    // Not linked: freed at its last release.
    let u = fs.tmpfile(1, 0o600, &who, true).unwrap();
    fs.write(u.ino, 0, &[1u8; 10_000], false).unwrap();
    fs.release_ino(u.ino);
    fs.sync().unwrap();
    assert_eq!(fs.statfs().inodes_free, inodes - 1, "only the published file holds an inode");
    // O_EXCL: never linkable.
    let x = fs.tmpfile(1, 0o600, &who, false).unwrap();
    assert_eq!(errno(fs.link(x.ino, 1, b"nope")), libc::ENOENT);
    // A crash while it is open: the next mount frees it.
    fs.write(x.ino, 0, b"lost", false).unwrap();
    fs.sync().unwrap();
    let image = dev.snapshot();
    fs.release_ino(x.ino);
    fs.unmount().unwrap();
    let crashed = std::sync::Arc::new(pwfs::device::mem::MemDevice::from_vec(image));
    let fs = pwfs::Fs::mount(crashed.clone(), test_config()).unwrap();
    assert_eq!(fs.statfs().inodes_free, inodes - 1, "the open tmpfile was freed at mount");
    assert_eq!(fs.read_file("/published").unwrap(), b"staged");
    fs.unmount().unwrap();
    fsck_clean(&*crashed);
    fsck_clean(&*dev);
}

/// A directory's noatime flag passes to the files, directories and symlinks made in it
/// (ext4's inherited flags); immutable and append-only do not.
#[test]
fn noatime_is_inherited_from_the_directory() {
    use pwfs::fs::{FS_APPEND_FL, FS_NOATIME_FL};
    let (dev, fs) = mem_fs(32 * MIB);
    let d = fs.create_dir("/d", 0o755).unwrap().ino;
    fs.set_flags(d, FS_NOATIME_FL).unwrap();
    fs.write_file("/d/f", b"x").unwrap();
    fs.create_dir("/d/sub", 0o755).unwrap();
    fs.symlink_path("f", "/d/l").unwrap();
    for p in ["/d/f", "/d/sub", "/d/l"] {
        let ino = fs.symlink_metadata(p).unwrap().ino;
        assert_eq!(fs.get_flags(ino).unwrap(), FS_NOATIME_FL, "{p}");
    }
    fs.write_file("/g", b"x").unwrap();
    assert_eq!(fs.get_flags(fs.metadata("/g").unwrap().ino).unwrap(), 0, "not from another directory");
    fs.set_flags(d, FS_NOATIME_FL | FS_APPEND_FL).unwrap();
    fs.write_file("/d/h", b"x").unwrap();
    assert_eq!(fs.get_flags(fs.metadata("/d/h").unwrap().ino).unwrap(), FS_NOATIME_FL, "append-only is not inherited");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// What the attribute calls answer at their edges, as on ext4: removing an ACL that is
/// not there succeeds (removing another missing name is ENODATA); names stop at what
/// one listxattr can return (ENOSPC), and the list still comes back whole.
#[test]
fn attribute_edges_match_ext4() {
    let (dev, fs) = mem_fs(64 * MIB);
    fs.write_file("/x", b"").unwrap();
    fs.create_dir("/d", 0o755).unwrap();
    let (x, d) = (fs.metadata("/x").unwrap().ino, fs.metadata("/d").unwrap().ino);
    fs.removexattr(x, b"system.posix_acl_access").unwrap();
    fs.removexattr(d, b"system.posix_acl_default").unwrap();
    assert_eq!(errno(fs.removexattr(x, b"user.none")), libc::ENODATA);
    // 200-byte names, 210 bytes each in the list: the 313th would pass 64 KiB.
    let name = |i: u32| format!("user.{i:04}{}", "n".repeat(191)).into_bytes();
    let mut n = 0;
    loop {
        match fs.setxattr(x, &name(n), b"v", false, false) {
            Ok(()) => n += 1,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENOSPC, "after {n} names");
                break;
            }
        }
    }
    assert_eq!(n, 65536 / (200 + 1) as u32, "names stop at one listxattr's worth");
    let listed = fs.listxattr(x).unwrap();
    assert_eq!(listed.len(), n as usize);
    assert!(listed.iter().map(|l| l.len() + 1).sum::<usize>() <= 65536);
    // Replacing one that is there still works.
    fs.setxattr(x, &name(0), b"w", false, true).unwrap();
    // Nanoseconds past a second: EINVAL, nothing stored (the inode would not load).
    let bad = pwfs::format::Timespec { sec: 5, nsec: 1_000_000_000 };
    for set in [
        pwfs::SetAttr { mtime: Some(TimeSet::At(bad)), ..Default::default() },
        pwfs::SetAttr { atime: Some(TimeSet::At(bad)), ..Default::default() },
        pwfs::SetAttr { ctime: Some(bad), ..Default::default() },
    ] {
        assert_eq!(errno(fs.setattr(x, &set)), libc::EINVAL);
    }
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// fallocate changes the modification and change times whether or not the size grows
/// (ext4 and XFS: KEEP_SIZE, inside the file, over allocated blocks).
#[test]
fn fallocate_sets_both_times() {
    use pwfs::fs::FALLOC_FL_KEEP_SIZE;
    let (_dev, fs) = mem_fs(64 * MIB);
    fs.write_file("/f", &vec![1u8; 64 << 10]).unwrap();
    let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
    f.set_len(1 << 20).unwrap();
    for (mode, off) in [(0, 200_000u64), (FALLOC_FL_KEEP_SIZE, 300_000), (FALLOC_FL_KEEP_SIZE, 2_000_000), (0, 200_000)]
    {
        let before = f.metadata().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(15));
        f.allocate(mode, off, 4096).unwrap();
        let after = f.metadata().unwrap();
        assert_eq!(after.size, 1 << 20, "mode {mode} at {off}");
        let t = |t: pwfs::format::Timespec| (t.sec, t.nsec);
        assert!(t(after.mtime) > t(before.mtime), "mode {mode} at {off}: mtime");
        assert!(t(after.ctime) > t(before.ctime), "mode {mode} at {off}: ctime");
    }
}

/// Names ending in '/' through the path calls, as the kernel's path walk treats them
/// (errno values checked against Linux 6.18): the slash asks for a directory.
#[test]
fn a_trailing_slash_asks_for_a_directory() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.write_file("/f", b"x").unwrap();
    fs.create_dir("/d", 0o755).unwrap();
    fs.create_dir("/d/sub", 0o755).unwrap();
    fs.symlink_path("d", "/ld").unwrap();
    assert_eq!(errno(fs.remove_file("/f/")), libc::ENOTDIR);
    assert_eq!(errno(fs.remove_file("/d/")), libc::EISDIR);
    assert_eq!(errno(fs.remove_file("/nope/")), libc::ENOENT);
    assert_eq!(errno(fs.rename_path("/f", "/g/")), libc::ENOTDIR);
    assert_eq!(errno(fs.rename_path("/f/", "/g")), libc::ENOTDIR);
    assert_eq!(errno(fs.rename_path("/ld/", "/l2")), libc::ENOTDIR, "the symlink is not moved");
    assert_eq!(errno(fs.hard_link("/f", "/new/")), libc::ENOENT);
    assert_eq!(errno(fs.hard_link("/f", "/d/")), libc::EEXIST);
    assert_eq!(errno(fs.symlink_path("x", "/new/")), libc::ENOENT);
    assert_eq!(errno(OpenOptions::new().write(true).create(true).open(&fs, "/new/")), libc::EISDIR);
    assert_eq!(errno(OpenOptions::new().write(true).create_new(true).open(&fs, "/new/")), libc::EISDIR);
    assert_eq!(errno(OpenOptions::new().write(true).create(true).open(&fs, "/nope/x/")), libc::ENOENT);
    assert_eq!(errno(OpenOptions::new().write(true).create(true).open(&fs, "/f/x/")), libc::ENOTDIR);
    assert!(fs.symlink_metadata("/ld/").unwrap().is_dir(), "a slash follows the last symlink");
    assert_eq!(errno(fs.symlink_metadata("/f/")), libc::ENOTDIR);
    for name in ["/f", "/d", "/ld"] {
        fs.symlink_metadata(name).unwrap();
    }
    for name in ["/g", "/l2", "/new"] {
        assert_eq!(errno(fs.symlink_metadata(name)), libc::ENOENT, "{name} was made");
    }
    // What a slash allows: directories.
    fs.rename_path("/d/sub/", "/d2/").unwrap();
    fs.create_dir("/d3/", 0o755).unwrap();
    fs.remove_dir("/d3/").unwrap();
    assert!(fs.metadata("/d2").unwrap().is_dir());
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Directory edges where the engine's API answered otherwise than Linux.
#[test]
fn directory_edges_match_linux() {
    let (dev, fs) = mem_fs(16 * MIB);
    // mkdir keeps no set-user-ID or set-group-ID the caller asked for (vfs_mkdir);
    // the sticky bit stays.
    let md = fs.create_dir("/s", 0o6755).unwrap();
    assert_eq!(md.mode & 0o7777, 0o755);
    assert_eq!(fs.create_dir("/t", 0o1777).unwrap().mode & 0o7777, 0o1777);
    // A file renamed onto a directory that holds it: the kernel's "trap", ENOTEMPTY.
    fs.create_dir("/s/in", 0o755).unwrap();
    fs.write_file("/s/in/x", b"x").unwrap();
    let s = fs.resolve("/s", false).unwrap();
    let root = fs.resolve("/", false).unwrap();
    let sin = fs.resolve("/s/in", false).unwrap();
    assert_eq!(errno(fs.rename(sin, b"x", s, b"in", false)), libc::ENOTEMPTY);
    assert_eq!(errno(fs.rename(sin, b"x", root, b"s", false)), libc::ENOTEMPTY);
    fs.create_dir("/e", 0o755).unwrap();
    assert_eq!(errno(fs.rename(sin, b"x", root, b"e", false)), libc::EISDIR, "not an ancestor");
    // RENAME_NOREPLACE onto "." or "..": EEXIST; a dot source stays EBUSY.
    assert_eq!(errno(fs.rename(sin, b"x", sin, b"..", true)), libc::EEXIST);
    assert_eq!(errno(fs.rename(sin, b"x", sin, b"..", false)), libc::EBUSY);
    assert_eq!(errno(fs.rename(sin, b".", s, b"y", true)), libc::EBUSY);
    // A removed directory lists nothing, not even "." and "..".
    let gone = fs.create_dir("/s/gone", 0o755).unwrap().ino;
    let held = OpenOptions::new().read(true).open(&fs, "/s/gone").unwrap();
    assert_eq!(fs.readdir(gone, 0, 10).unwrap().len(), 2);
    fs.remove_dir("/s/gone").unwrap();
    assert_eq!(fs.readdir(gone, 0, 10).unwrap().len(), 0);
    drop(held);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// O_CREAT through a symlink whose target does not exist creates the target, as on
/// Linux; O_EXCL does not follow (EEXIST), and a loop of links is ELOOP.
#[test]
fn o_creat_through_a_dangling_symlink_creates_its_target() {
    let (dev, fs) = mem_fs(16 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    fs.symlink_path("t1", "/l1").unwrap();
    fs.symlink_path("../t2", "/d/l2").unwrap();
    fs.symlink_path("/d/l2", "/l3").unwrap();
    let rw = || OpenOptions::new().write(true).create(true).clone();
    rw().open(&fs, "/l1").unwrap().write_at(b"one", 0).unwrap();
    assert_eq!(fs.read_file("/t1").unwrap(), b"one");
    rw().open(&fs, "/l3").unwrap().write_at(b"two", 0).unwrap();
    assert_eq!(fs.read_file("/t2").unwrap(), b"two", "through two links, the second relative");
    fs.symlink_path("t4", "/l4").unwrap();
    assert_eq!(errno(OpenOptions::new().write(true).create_new(true).open(&fs, "/l4")), libc::EEXIST);
    assert_eq!(errno(fs.symlink_metadata("/t4")), libc::ENOENT);
    fs.symlink_path("/m2", "/m1").unwrap();
    fs.symlink_path("/m1", "/m2").unwrap();
    assert_eq!(errno(rw().open(&fs, "/m1")), libc::ELOOP);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Path limits as Linux: a path of PATH_MAX (4096) bytes or more is ENAMETOOLONG; a
/// symlink target of up to 4095 bytes is kept whole (in a block of its own past the
/// inline size) and reads back after a remount, one of 4096 is ENAMETOOLONG.
#[test]
fn path_and_symlink_target_limits() {
    let (dev, fs) = mem_fs(16 << 20);
    let deep = format!("/{}", ["d"; 2048].join("/"));
    assert_eq!(deep.len(), 4096);
    assert_eq!(errno(fs.metadata(&deep)), libc::ENAMETOOLONG);
    assert_eq!(errno(fs.create(&deep)), libc::ENAMETOOLONG);
    let target: Vec<u8> = (0..4095).map(|i| b'a' + (i % 26) as u8).collect();
    fs.symlink_path(&target, "/long").unwrap();
    assert_eq!(errno(fs.symlink_path(vec![b'x'; 4096], "/toolong")), libc::ENAMETOOLONG);
    assert_eq!(errno(fs.symlink_metadata("/toolong")), libc::ENOENT);
    assert_eq!(fs.read_link("/long").unwrap(), target);
    assert_eq!(fs.symlink_metadata("/long").unwrap().size, 4095);
    fs.unmount().unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_link("/long").unwrap(), target);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}
