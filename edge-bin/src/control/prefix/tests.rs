use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use iop_engine::rng::SplitMix64;

use super::*;

const A: ProviderId = ProviderId(1);
const B: ProviderId = ProviderId(2);

fn spec(budget_bytes: usize, prefix_bytes_max: usize) -> PrefixTreeSpec {
    PrefixTreeSpec {
        budget_bytes,
        prefix_bytes_max,
    }
}

fn unbounded() -> PrefixTree {
    PrefixTree::new(spec(usize::MAX, 1 << 20)).unwrap()
}

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

fn found(matched_len: usize, providers: &[(ProviderId, Instant)]) -> Match {
    Match {
        matched_len,
        providers: providers.to_vec(),
    }
}

impl PrefixTree {
    /// Checks the tree's structure against its definition: every reachable
    /// node is well linked, keyed by its first byte, holds a subset of its
    /// parent's stamps (none newer), costs what `node_cost` says; the total
    /// is the sum; the LRU index is exactly the leaves under their last use.
    fn check(&self) {
        let mut total = 0;
        let mut reached = 0;
        let mut leaves = BTreeSet::new();
        let mut stack = vec![ROOT];
        while let Some(ix) = stack.pop() {
            let node = self.node(ix);
            reached += 1;
            assert_eq!(node.cost, node_cost(node), "cost of node {ix}");
            total += node.cost;
            assert!(
                node.providers.windows(2).all(|w| w[0].0 < w[1].0),
                "stamps sorted and unique at {ix}"
            );
            assert!(
                node.children.windows(2).all(|w| w[0].0 < w[1].0),
                "children sorted and unique at {ix}"
            );
            if ix == ROOT {
                assert!(node.label.is_empty() && node.providers.is_empty());
            } else {
                assert!(!node.label.is_empty(), "empty label at {ix}");
                assert!(!node.providers.is_empty(), "no stamps at {ix}");
                if node.children.is_empty() {
                    leaves.insert((last_used(&node.providers).unwrap(), ix));
                }
            }
            for &(first, child) in &node.children {
                let c = self.node(child);
                assert_eq!(c.parent, ix);
                assert_eq!(c.label[0], first);
                if ix != ROOT {
                    for &(p, t) in &c.providers {
                        let i = node
                            .providers
                            .binary_search_by_key(&p, |&(q, _)| q)
                            .unwrap_or_else(|_| panic!("{p:?} at {child} not at parent {ix}"));
                        assert!(node.providers[i].1 >= t, "child stamp newer than parent's");
                    }
                }
                stack.push(child);
            }
        }
        assert_eq!(total, self.bytes, "bytes is the sum of node costs");
        assert_eq!(reached, self.node_count(), "every live node is reachable");
        assert_eq!(leaves, self.lru, "the LRU index is the leaves");
    }
}

#[test]
fn a_budget_below_an_empty_tree_is_refused() {
    assert_eq!(
        PrefixTree::new(spec(PrefixTree::EMPTY_BYTES - 1, 16)).unwrap_err(),
        PrefixTreeError::BudgetTooSmall {
            budget_bytes: PrefixTree::EMPTY_BYTES - 1,
            empty_bytes: PrefixTree::EMPTY_BYTES,
        }
    );
    let tree = PrefixTree::new(spec(PrefixTree::EMPTY_BYTES, 16)).unwrap();
    assert_eq!(tree.bytes(), PrefixTree::EMPTY_BYTES);
    assert_eq!(tree.node_count(), 1);
}

#[test]
fn an_inserted_text_matches_exactly_and_by_prefix() {
    let t0 = iop_engine::clock::now();
    let mut tree = unbounded();
    tree.insert(b"hello world", A, t0);
    tree.check();
    assert_eq!(tree.node_count(), 2);
    assert_eq!(tree.longest_match(b"hello world"), found(11, &[(A, t0)]));
    assert_eq!(
        tree.longest_match(b"hello world, again"),
        found(11, &[(A, t0)])
    );
    assert_eq!(tree.longest_match(b"hello there"), found(6, &[(A, t0)]));
    assert_eq!(tree.longest_match(b"h"), found(1, &[(A, t0)]));
    assert_eq!(tree.longest_match(b"xyz"), found(0, &[]));
    assert_eq!(tree.longest_match(b""), found(0, &[]));
    // Matching changes nothing.
    assert_eq!(tree.node_count(), 2);
}

#[test]
fn a_divergence_splits_the_edge_and_both_providers_share_the_head() {
    let base = iop_engine::clock::now();
    let (t0, t1) = (at(base, 0), at(base, 1));
    let mut tree = unbounded();
    tree.insert(b"abcdef", A, t0);
    tree.insert(b"abcxyz", B, t1);
    tree.check();
    // root, "abc" {A,B}, "def" {A}, "xyz" {B}.
    assert_eq!(tree.node_count(), 4);
    let mid = tree.child(ROOT, b'a').unwrap();
    assert_eq!(&*tree.node(mid).label, b"abc");
    assert_eq!(tree.node(mid).providers, vec![(A, t0), (B, t1)]);
    let def = tree.child(mid, b'd').unwrap();
    let xyz = tree.child(mid, b'x').unwrap();
    assert_eq!(&*tree.node(def).label, b"def");
    assert_eq!(&*tree.node(xyz).label, b"xyz");

    assert_eq!(tree.longest_match(b"abc"), found(3, &[(A, t0), (B, t1)]));
    assert_eq!(tree.longest_match(b"abq"), found(2, &[(A, t0), (B, t1)]));
    assert_eq!(tree.longest_match(b"abcdq"), found(4, &[(A, t0)]));
    assert_eq!(tree.longest_match(b"abcxyz!"), found(6, &[(B, t1)]));
}

#[test]
fn a_text_ending_inside_an_edge_splits_it_there() {
    let base = iop_engine::clock::now();
    let (t0, t1) = (at(base, 0), at(base, 1));
    let mut tree = unbounded();
    tree.insert(b"abcdef", A, t0);
    tree.insert(b"abc", B, t1);
    tree.check();
    assert_eq!(tree.node_count(), 3);
    assert_eq!(tree.longest_match(b"abc"), found(3, &[(A, t0), (B, t1)]));
    assert_eq!(tree.longest_match(b"abcd"), found(4, &[(A, t0)]));
}

#[test]
fn the_longest_match_is_the_deeper_node_and_its_providers_only() {
    let base = iop_engine::clock::now();
    let mut tree = unbounded();
    tree.insert(b"ab", A, at(base, 0));
    tree.insert(b"abcdef", B, at(base, 1));
    tree.insert(b"abcdef", A, at(base, 2));
    tree.insert(b"abcdXY", B, at(base, 3));
    tree.check();
    assert_eq!(
        tree.longest_match(b"abcdeQ"),
        found(5, &[(A, at(base, 2)), (B, at(base, 1))])
    );
    assert_eq!(tree.longest_match(b"abcdX"), found(5, &[(B, at(base, 3))]));
    // A's last use of "abcd" is its insert of "abcdef"; B's is "abcdXY".
    assert_eq!(
        tree.longest_match(b"abcd"),
        found(4, &[(A, at(base, 2)), (B, at(base, 3))])
    );
    // A re-insert refreshes the stamps along its path only.
    tree.insert(b"abc", B, at(base, 9));
    tree.check();
    assert_eq!(
        tree.longest_match(b"abc"),
        found(3, &[(A, at(base, 2)), (B, at(base, 9))])
    );
    assert_eq!(tree.longest_match(b"abcdX"), found(5, &[(B, at(base, 3))]));
    // A stamp never moves back in time.
    tree.insert(b"abcdXY", B, at(base, 1));
    assert_eq!(tree.longest_match(b"abcdX"), found(5, &[(B, at(base, 3))]));
    tree.check();
}

#[test]
fn a_label_counts_its_bytes_exactly() {
    let t0 = iop_engine::clock::now();
    let mut short = unbounded();
    short.insert(b"hello", A, t0);
    let mut long = unbounded();
    long.insert(b"hello, world", A, t0);
    assert_eq!(long.bytes() - short.bytes(), 7);
    assert!(short.bytes() >= PrefixTree::EMPTY_BYTES + NODE_OVERHEAD_BYTES + 5);
    short.check();
    long.check();
}

#[test]
fn eviction_drops_the_least_recently_used_leaf_first_and_keeps_the_budget() {
    let base = iop_engine::clock::now();
    let texts: [&[u8]; 5] = [
        b"aaaaaaaa",
        b"bbbbbbbb",
        b"cccccccc",
        b"dddddddd",
        b"eeeeeeee",
    ];
    // The budget holds exactly three of these disjoint leaves.
    let mut probe = unbounded();
    for (i, text) in texts[..3].iter().enumerate() {
        probe.insert(text, A, at(base, i as u64));
    }
    let budget = probe.bytes();
    let mut tree = PrefixTree::new(spec(budget, 64)).unwrap();
    for (i, text) in texts[..3].iter().enumerate() {
        tree.insert(text, A, at(base, i as u64));
        assert!(tree.bytes() <= budget);
    }
    assert_eq!(tree.bytes(), budget);

    // A fourth evicts the oldest ("a", t0).
    tree.insert(texts[3], A, at(base, 3));
    tree.check();
    assert!(tree.bytes() <= budget);
    assert_eq!(tree.longest_match(texts[0]).matched_len, 0);
    for text in &texts[1..4] {
        assert_eq!(tree.longest_match(text).matched_len, 8);
    }

    // Touch "b" (now the newest); a fifth then evicts "c", not "b".
    tree.insert(texts[1], A, at(base, 4));
    assert!(tree.bytes() <= budget);
    tree.insert(texts[4], A, at(base, 5));
    tree.check();
    assert!(tree.bytes() <= budget);
    assert_eq!(tree.longest_match(texts[2]).matched_len, 0);
    assert_eq!(tree.longest_match(texts[1]), found(8, &[(A, at(base, 4))]));
    assert_eq!(tree.longest_match(texts[3]).matched_len, 8);
    assert_eq!(tree.longest_match(texts[4]).matched_len, 8);
}

#[test]
fn eviction_climbs_to_a_parent_that_becomes_a_leaf_in_its_own_lru_turn() {
    let base = iop_engine::clock::now();
    let mut tree = unbounded();
    tree.insert(b"shared|1", A, at(base, 0));
    tree.insert(b"shared|2", B, at(base, 1));
    tree.insert(b"zzzz", A, at(base, 2));
    let budget = tree.bytes();
    let mut tree = PrefixTree::new(spec(budget, 64)).unwrap();
    tree.insert(b"shared|1", A, at(base, 0));
    tree.insert(b"shared|2", B, at(base, 1));
    tree.insert(b"zzzz", A, at(base, 2));
    assert_eq!(tree.bytes(), budget);

    // New 4-byte leaves, newer than everything, until "shared|" (last
    // used at t1, older than "zzzz") is evicted too.
    let mut added: Vec<[u8; 4]> = Vec::new();
    let mut saw_bare_head = false;
    for i in 0..20u8 {
        let text = [b'a' + i; 4];
        tree.insert(&text, A, at(base, 3 + u64::from(i)));
        added.push(text);
        tree.check();
        assert!(tree.bytes() <= budget);
        let one = tree.longest_match(b"shared|1").matched_len;
        let two = tree.longest_match(b"shared|2").matched_len;
        // The older leaf goes no later than the newer one.
        assert!(!(one == 8 && two < 8), "one {one} two {two}");
        if one == 7 && two == 7 {
            // Both leaves gone, the head left as a leaf (last use t1).
            saw_bare_head = true;
            assert_eq!(
                tree.longest_match(b"shared|"),
                found(7, &[(A, at(base, 0)), (B, at(base, 1))])
            );
        }
        // Everything newer than the head outlives it.
        assert_eq!(tree.longest_match(b"zzzz").matched_len, 4);
        for text in &added {
            assert_eq!(tree.longest_match(text).matched_len, 4);
        }
        if two == 0 {
            assert_eq!(one, 0);
            assert!(saw_bare_head, "the head went with its last leaf");
            break;
        }
    }
    assert_eq!(tree.longest_match(b"shared|2").matched_len, 0);

    // A text longer than the whole budget leaves the tree within it.
    let mut tiny = PrefixTree::new(spec(PrefixTree::EMPTY_BYTES + 10, 1 << 20)).unwrap();
    tiny.insert(&[b'z'; 4096], A, base);
    tiny.check();
    assert_eq!(tiny.bytes(), PrefixTree::EMPTY_BYTES);
    assert_eq!(tiny.node_count(), 1);
    assert_eq!(tiny.longest_match(b"zzz"), found(0, &[]));
}

#[test]
fn removing_a_provider_drops_its_stamps_and_the_nodes_only_it_held() {
    let base = iop_engine::clock::now();
    let (t0, t1) = (at(base, 0), at(base, 1));
    let mut tree = unbounded();
    let empty = tree.bytes();
    tree.insert(b"abcdef", A, t0);
    tree.insert(b"abcxyz", B, t1);
    tree.insert(b"qrs", A, t0);
    assert_eq!(tree.node_count(), 5);

    tree.remove_provider(A);
    tree.check();
    assert_eq!(tree.node_count(), 3);
    assert_eq!(tree.longest_match(b"abcdef"), found(3, &[(B, t1)]));
    assert_eq!(tree.longest_match(b"abcxyz"), found(6, &[(B, t1)]));
    assert_eq!(tree.longest_match(b"qrs"), found(0, &[]));

    // Removing an absent provider changes nothing.
    let bytes = tree.bytes();
    tree.remove_provider(ProviderId(99));
    assert_eq!(tree.bytes(), bytes);
    assert_eq!(tree.node_count(), 3);

    tree.remove_provider(B);
    tree.check();
    assert_eq!(tree.node_count(), 1);
    assert_eq!(tree.bytes(), empty);
    assert_eq!(tree.longest_match(b"abcxyz"), found(0, &[]));

    // Freed slots are reused.
    tree.insert(b"abc", A, t0);
    tree.check();
    assert_eq!(tree.nodes.len(), 5);
    assert_eq!(tree.longest_match(b"abc"), found(3, &[(A, t0)]));
}

#[test]
fn only_the_first_prefix_bytes_max_of_a_text_are_considered() {
    let t0 = iop_engine::clock::now();
    let mut tree = PrefixTree::new(spec(usize::MAX, 8)).unwrap();
    let huge = vec![b'p'; 1 << 20];
    tree.insert(&huge, A, t0);
    tree.check();
    assert_eq!(tree.node_count(), 2);
    let leaf = tree.child(ROOT, b'p').unwrap();
    assert_eq!(tree.node(leaf).label.len(), 8);
    assert_eq!(tree.longest_match(&huge), found(8, &[(A, t0)]));
    let mut other = huge.clone();
    other[100] = b'q';
    assert_eq!(tree.longest_match(&other), found(8, &[(A, t0)]));
    assert_eq!(tree.longest_match(b"ppp"), found(3, &[(A, t0)]));
}

/// Per provider, the (capped) texts it inserted, each with its time.
struct Model {
    texts: Vec<Vec<(Vec<u8>, Instant)>>,
}

impl Model {
    /// The longest common prefix of `query` with any text of any provider,
    /// the providers reaching it, each with its newest text reaching it.
    fn longest_match(&self, query: &[u8]) -> Match {
        let lcp_of = |p: usize| {
            self.texts[p]
                .iter()
                .map(|(text, _)| common_prefix_len(text, query))
                .max()
                .unwrap_or(0)
        };
        let best = (0..self.texts.len()).map(lcp_of).max().unwrap_or(0);
        if best == 0 {
            return found(0, &[]);
        }
        let providers = (0..self.texts.len())
            .filter(|&p| lcp_of(p) == best)
            .map(|p| {
                let newest = self.texts[p]
                    .iter()
                    .filter(|(text, _)| common_prefix_len(text, query) >= best)
                    .map(|&(_, t)| t)
                    .max()
                    .unwrap();
                (ProviderId(p as u32), newest)
            })
            .collect::<Vec<_>>();
        found(best, &providers)
    }
}

fn random_text(rng: &mut SplitMix64) -> Vec<u8> {
    // A small alphabet and short texts, so prefixes are shared often.
    let len = rng.below(21) as usize;
    (0..len).map(|_| b"abc"[rng.below(3) as usize]).collect()
}

#[test]
fn longest_match_agrees_with_a_brute_force_model() {
    let seed = std::env::var("PREFIX_TREE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x005e_ed41);
    println!("prefix tree model seed: {seed} (PREFIX_TREE_SEED={seed} replays it)");
    let mut rng = SplitMix64::new(seed);
    const PROVIDERS: usize = 4;
    const PREFIX_BYTES_MAX: usize = 16;
    let mut tree = PrefixTree::new(spec(usize::MAX, PREFIX_BYTES_MAX)).unwrap();
    let mut model = Model {
        texts: vec![Vec::new(); PROVIDERS],
    };
    let base = iop_engine::clock::now();
    let mut queries = 0;
    for step in 0..4000u64 {
        // Times mostly advance, sometimes repeat.
        let now = at(base, step / 2);
        match rng.below(10) {
            0..=5 => {
                let text = random_text(&mut rng);
                let p = rng.below(PROVIDERS as u64) as usize;
                tree.insert(&text, ProviderId(p as u32), now);
                let capped = text[..text.len().min(PREFIX_BYTES_MAX)].to_vec();
                model.texts[p].push((capped, now));
            }
            6 => {
                let p = rng.below(PROVIDERS as u64) as usize;
                tree.remove_provider(ProviderId(p as u32));
                model.texts[p].clear();
            }
            _ => {
                let query = random_text(&mut rng);
                assert_eq!(
                    tree.longest_match(&query),
                    model.longest_match(&query),
                    "seed {seed} step {step} query {:?}",
                    String::from_utf8_lossy(&query)
                );
                queries += 1;
            }
        }
        if step % 50 == 0 {
            tree.check();
        }
    }
    tree.check();
    assert!(queries > 1000, "only {queries} queries");
}

#[test]
fn random_inserts_under_a_small_budget_never_exceed_it() {
    let seed = 0x41b0_d6e7;
    println!("prefix tree budget seed: {seed}");
    let mut rng = SplitMix64::new(seed);
    let budget = PrefixTree::EMPTY_BYTES + 12 * NODE_OVERHEAD_BYTES;
    let mut tree = PrefixTree::new(spec(budget, 64)).unwrap();
    // The same inserts without a budget: what eviction had to shed.
    let mut twin = unbounded();
    let base = iop_engine::clock::now();
    for step in 0..3000u64 {
        let text = random_text(&mut rng);
        let provider = ProviderId(rng.below(3) as u32);
        tree.insert(&text, provider, at(base, step));
        twin.insert(&text, provider, at(base, step));
        assert!(
            tree.bytes() <= budget,
            "seed {seed} step {step}: {} > {budget}",
            tree.bytes()
        );
        tree.check();
        // Eviction takes every older leaf before the newest path, and a
        // node of this text alone fits the budget: some of it survives.
        if !text.is_empty() {
            let m = tree.longest_match(&text);
            assert!(m.matched_len > 0, "seed {seed} step {step}");
        }
        if rng.below(50) == 0 {
            let provider = ProviderId(rng.below(3) as u32);
            tree.remove_provider(provider);
            twin.remove_provider(provider);
            tree.check();
        }
    }
    assert!(twin.bytes() > 4 * budget, "eviction was exercised");
}
