//! Fidelity: how much of a recorded sequence of allocator decisions a replay reproduces, alike
//! and in the same order.

/// The length of the longest common subsequence of `a` and `b`, or `None` when they differ by
/// more than `max_edits` insertions and deletions. Myers' search costs O((N + M) D) for D
/// edits: fast for the close sequences a faithful replay gives, bounded for the others.
pub fn matched_in_order<T: PartialEq>(a: &[T], b: &[T], max_edits: usize) -> Option<usize> {
    let (n, m) = (a.len() as isize, b.len() as isize);
    let max = (max_edits as isize).min(n + m);
    let offset = max + 1;
    // furthest[k + offset]: the furthest x reached on diagonal k = x - y.
    let mut furthest = vec![0isize; 2 * max as usize + 3];
    for edits in 0..=max {
        for k in (-edits..=edits).step_by(2) {
            let at = (k + offset) as usize;
            let down = k == -edits || (k != edits && furthest[at - 1] < furthest[at + 1]);
            let mut x = if down { furthest[at + 1] } else { furthest[at - 1] + 1 };
            let mut y = x - k;
            while x < n && y < m && a[x as usize] == b[y as usize] {
                x += 1;
                y += 1;
            }
            furthest[at] = x;
            if x >= n && y >= m {
                return Some(((n + m - edits) / 2) as usize);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::matched_in_order;

    #[test]
    fn counts_the_longest_common_subsequence() {
        assert_eq!(matched_in_order(&[1, 2, 3], &[1, 2, 3], 10), Some(3));
        assert_eq!(matched_in_order(&[20, 20, 2, 20], &[20, 2, 20, 20], 10), Some(3));
        assert_eq!(matched_in_order::<u8>(&[], &[], 0), Some(0));
        assert_eq!(matched_in_order(&[1, 2], &[], 2), Some(0));
        assert_eq!(matched_in_order(&[1, 2, 3, 4], &[5, 6, 7, 8], 7), None, "8 edits needed");
        assert_eq!(matched_in_order(&[1, 2, 3, 4], &[5, 6, 7, 8], 8), Some(0));
    }

    /// The search agrees with the textbook quadratic table on every small pair.
    #[test]
    fn agrees_with_dynamic_programming() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for _ in 0..300 {
            let a: Vec<usize> = (0..next() % 12).map(|_| next() % 3).collect();
            let b: Vec<usize> = (0..next() % 12).map(|_| next() % 3).collect();
            let mut table = vec![vec![0; b.len() + 1]; a.len() + 1];
            for i in 1..=a.len() {
                for j in 1..=b.len() {
                    table[i][j] = if a[i - 1] == b[j - 1] {
                        table[i - 1][j - 1] + 1
                    } else {
                        table[i - 1][j].max(table[i][j - 1])
                    };
                }
            }
            assert_eq!(matched_in_order(&a, &b, a.len() + b.len()), Some(table[a.len()][b.len()]), "{a:?} {b:?}");
        }
    }
}
