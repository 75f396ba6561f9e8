//! Permission rules the engine applies for every front end (issue 11): set-id bits
//! cleared by unprivileged writes and truncates and by chown, set-group-ID directories
//! passed on, POSIX ACLs kept in step with the mode and inherited.

mod common;
use common::*;
use pwfs::fs::perm::{self, Acl};
use pwfs::{Creator, SetAttr};

const S_IFREG: u32 = 0o100000;

fn mode(fs: &pwfs::Fs, ino: u64) -> u32 {
    fs.getattr(ino).unwrap().mode & 0o7777
}

/// The xattr form of an ACL: (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

const U: u16 = perm::ACL_USER_OBJ;
const NU: u16 = perm::ACL_USER;
const G: u16 = perm::ACL_GROUP_OBJ;
const M: u16 = perm::ACL_MASK;
const O: u16 = perm::ACL_OTHER;
const NONE: u32 = u32::MAX;

#[test]
fn writes_and_truncates_of_the_unprivileged_clear_set_id_bits() {
    let (dev, fs) = mem_fs(16 * MIB);
    let root = Creator::new(0, 0);
    let f = fs.mknod(1, b"f", S_IFREG | 0o6777, 0, &root).unwrap().ino;
    assert_eq!(mode(&fs, f), 0o6777);
    assert!(fs.remove_privs(f, &|_| true).unwrap(), "S_ISUID, and S_ISGID with group execute");
    assert_eq!(mode(&fs, f), 0o777);
    assert!(!fs.remove_privs(f, &|_| true).unwrap(), "nothing left to clear");
    // S_ISGID without group execute marks mandatory locking: it stays for a writer in
    // the file's group, and goes for anyone else (Linux 6.2+).
    fs.setattr(f, &SetAttr { mode: Some(0o6745), gid: Some(5), ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o6745);
    let asked = std::cell::Cell::new(None);
    fs.remove_privs(f, &|g| {
        asked.set(Some(g));
        true
    })
    .unwrap();
    assert_eq!((mode(&fs, f), asked.get()), (0o2745, Some(5)), "a member keeps S_ISGID; the file's group asked");
    assert!(fs.remove_privs(f, &|_| false).unwrap());
    assert_eq!(mode(&fs, f), 0o745, "an outsider clears it");
    // So does a chown by an outsider; a chown to the same owner (ctime alone, as the
    // kernel sends chown(f, -1, -1)) clears S_ISUID and sets ctime.
    fs.setattr(f, &SetAttr { mode: Some(0o6745), ..Default::default() }).unwrap();
    fs.setattr(f, &SetAttr { gid: Some(5), ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o2745, "a chown by a member (or root) keeps it");
    fs.setattr(f, &SetAttr { gid: Some(6), outsider: true, ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o745);
    fs.setattr(f, &SetAttr { mode: Some(0o4745), ..Default::default() }).unwrap();
    let before = fs.getattr(f).unwrap().ctime;
    let at = pwfs::format::Timespec { sec: before.sec + 100, nsec: 0 };
    fs.setattr(f, &SetAttr { ctime: Some(at), kill_setid: true, ..Default::default() }).unwrap();
    assert_eq!((mode(&fs, f), fs.getattr(f).unwrap().ctime), (0o745, at));
    // A truncate by the unprivileged.
    fs.setattr(f, &SetAttr { mode: Some(0o4755), ..Default::default() }).unwrap();
    fs.setattr(f, &SetAttr { size: Some(0), kill_setid: true, ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o755);
    // A truncate by root keeps them.
    fs.setattr(f, &SetAttr { mode: Some(0o4755), ..Default::default() }).unwrap();
    fs.setattr(f, &SetAttr { size: Some(10), ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o4755);
    // chown by anyone clears them from a file, not from a directory.
    fs.setattr(f, &SetAttr { uid: Some(7), ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, f), 0o755);
    // mkdir(2) keeps no set-ID bits (vfs_mkdir): a chmod sets them.
    let d = fs.mkdir(1, b"d", 0o6755, &root).unwrap().ino;
    assert_eq!(mode(&fs, d), 0o755);
    fs.setattr(d, &SetAttr { mode: Some(0o6755), ..Default::default() }).unwrap();
    fs.setattr(d, &SetAttr { gid: Some(7), ..Default::default() }).unwrap();
    assert_eq!(mode(&fs, d), 0o6755);
    assert!(!fs.remove_privs(d, &|_| true).unwrap());
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(mode(&fs, f), 0o755, "durable");
    fs.unmount().unwrap();
}

#[test]
fn set_group_id_directories_pass_on_their_group() {
    let (dev, fs) = mem_fs(16 * MIB);
    let d = fs.mkdir(1, b"d", 0o777, &Creator::new(0, 50)).unwrap().ino;
    fs.setattr(d, &SetAttr { mode: Some(0o2777), ..Default::default() }).unwrap();
    let user = Creator::new(1000, 1000);
    let f = fs.mknod(d, b"f", S_IFREG | 0o644, 0, &user).unwrap();
    assert_eq!((f.uid, f.gid), (1000, 50), "the directory's group");
    let sub = fs.mkdir(d, b"sub", 0o755, &user).unwrap();
    assert_eq!((sub.gid, sub.mode & 0o7777), (50, 0o2755), "a subdirectory is set-group-ID too");
    let deeper = fs.mknod(sub.ino, b"g", S_IFREG | 0o600, 0, &user).unwrap();
    assert_eq!(deeper.gid, 50, "and passes it on");
    let link = fs.symlink(d, b"l", b"f", &user).unwrap();
    assert_eq!(link.gid, 50);
    // Not in the group: no S_ISGID on a group-executable file; a member keeps it.
    let x = fs.mknod(d, b"x", S_IFREG | 0o2755, 0, &user).unwrap();
    assert_eq!(x.mode & 0o7777, 0o755);
    let member = Creator { groups: vec![50], ..user.clone() };
    let y = fs.mknod(d, b"y", S_IFREG | 0o2755, 0, &member).unwrap();
    assert_eq!(y.mode & 0o7777, 0o2755);
    // Elsewhere, the creator's group.
    let plain = fs.mknod(1, b"p", S_IFREG | 0o2755, 0, &user).unwrap();
    assert_eq!((plain.gid, plain.mode & 0o7777), (1000, 0o2755));
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn access_acls_set_the_mode_and_follow_chmod() {
    let (dev, fs) = mem_fs(16 * MIB);
    let root = Creator::new(0, 0);
    let f = fs.mknod(1, b"f", S_IFREG | 0o644, 0, &root).unwrap().ino;
    let full = acl(&[(U, 6, NONE), (NU, 7, 65534), (G, 4, NONE), (M, 6, NONE), (O, 0, NONE)]);
    fs.setxattr(f, perm::ACL_ACCESS, &full, false, false).unwrap();
    assert_eq!(mode(&fs, f), 0o660, "owner, mask, other");
    assert_eq!(fs.getxattr(f, perm::ACL_ACCESS).unwrap(), full);
    // chmod moves the mask (not the owning group's entry) and the others.
    fs.setattr(f, &SetAttr { mode: Some(0o705), ..Default::default() }).unwrap();
    let now = fs.getxattr(f, perm::ACL_ACCESS).unwrap();
    assert_eq!(now, acl(&[(U, 7, NONE), (NU, 7, 65534), (G, 4, NONE), (M, 0, NONE), (O, 5, NONE)]));
    // An ACL a mode says all of is not kept: only the mode changes.
    fs.setxattr(f, perm::ACL_ACCESS, &acl(&[(U, 7, NONE), (G, 5, NONE), (O, 1, NONE)]), false, false).unwrap();
    assert_eq!(mode(&fs, f), 0o751);
    assert_eq!(errno(fs.getxattr(f, perm::ACL_ACCESS)), libc::ENODATA);
    // Malformed: EINVAL, nothing changed. A default ACL on a file: EACCES.
    let bad = [
        acl(&[(U, 7, NONE), (NU, 7, 5), (G, 5, NONE), (O, 0, NONE)]),
        acl(&[(U, 7, NONE), (O, 0, NONE)]),
        full[..full.len() - 2].to_vec(),
        vec![],
    ];
    for b in &bad {
        assert_eq!(errno(fs.setxattr(f, perm::ACL_ACCESS, b, false, false)), libc::EINVAL, "{b:?}");
    }
    assert_eq!(mode(&fs, f), 0o751);
    assert_eq!(errno(fs.setxattr(f, perm::ACL_DEFAULT, &full, false, false)), libc::EACCES);
    assert_eq!(errno(fs.setxattr(f, b"system.other", b"x", false, false)), libc::EOPNOTSUPP);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn default_acls_are_inherited_instead_of_the_umask() {
    let (dev, fs) = mem_fs(16 * MIB);
    let root = Creator { umask: 0o077, ..Creator::new(0, 0) };
    let d = fs.mkdir(1, b"d", 0o777, &root).unwrap();
    assert_eq!(d.mode & 0o777, 0o700, "no default ACL: the umask applies");
    let default = acl(&[(U, 7, NONE), (NU, 7, 65534), (G, 5, NONE), (M, 7, NONE), (O, 5, NONE)]);
    fs.setxattr(d.ino, perm::ACL_DEFAULT, &default, false, false).unwrap();
    let f = fs.mknod(d.ino, b"f", S_IFREG | 0o666, 0, &root).unwrap();
    assert_eq!(f.mode & 0o777, 0o664, "the default ACL masks the mode, not the umask");
    let access = Acl::decode(&fs.getxattr(f.ino, perm::ACL_ACCESS).unwrap()).unwrap().unwrap();
    assert_eq!(access.mode_bits(), 0o664);
    assert!(access.entries().iter().any(|e| e.tag == NU && e.id == 65534 && e.perm == 7));
    assert_eq!(errno(fs.getxattr(f.ino, perm::ACL_DEFAULT)), libc::ENODATA, "files get no default ACL");
    let sub = fs.mkdir(d.ino, b"sub", 0o777, &root).unwrap();
    assert_eq!(sub.mode & 0o777, 0o775);
    assert_eq!(fs.getxattr(sub.ino, perm::ACL_DEFAULT).unwrap(), default, "directories inherit it");
    let deeper = fs.mknod(sub.ino, b"g", S_IFREG | 0o600, 0, &root).unwrap();
    assert_eq!(deeper.mode & 0o777, 0o600);
    let l = fs.symlink(d.ino, b"l", b"f", &root).unwrap();
    assert_eq!(l.mode & 0o777, 0o777, "symlinks take neither");
    assert_eq!(errno(fs.getxattr(l.ino, perm::ACL_ACCESS)), libc::ENODATA);
    // A minimal default ACL gives the mode it implies and no access ACL.
    let e = fs.mkdir(1, b"e", 0o777, &root).unwrap().ino;
    fs.setxattr(e, perm::ACL_DEFAULT, &acl(&[(U, 7, NONE), (G, 0, NONE), (O, 0, NONE)]), false, false).unwrap();
    let g = fs.mknod(e, b"g", S_IFREG | 0o666, 0, &root).unwrap();
    assert_eq!(g.mode & 0o777, 0o600);
    assert_eq!(errno(fs.getxattr(g.ino, perm::ACL_ACCESS)), libc::ENODATA);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.getxattr(sub.ino, perm::ACL_DEFAULT).unwrap(), default, "durable");
    fs.unmount().unwrap();
}

#[test]
fn umask_and_sgid_dirs_through_the_path_api() {
    let (_dev, fs) = mem_fs(16 * MIB);
    fs.create_dir("/d", 0o777).unwrap();
    fs.set_permissions("/d", 0o2777).unwrap();
    fs.set_owner("/d", None, Some(50)).unwrap();
    let f = pwfs::OpenOptions::new().write(true).create(true).owner(1000, 1000).open(&fs, "/d/f").unwrap();
    let md = f.metadata().unwrap();
    assert_eq!((md.uid, md.gid), (1000, 50));
    assert_eq!(fs.metadata("/d").unwrap().mode & 0o7777, 0o2777, "a directory keeps its bits across chown");
}
