// Package golden checks what an adapter exports against a list written at
// an earlier commit: every line of it must stay, and every line more be
// listed as added since, so that none comes or goes unseen.
package golden

import (
	"os"
	"slices"
	"strings"
	"testing"
)

// Check fails t for a line of file (one a line) that got lacks, and when
// got is not file's lines and added, in any order; n is the number of
// lines file must have, so that a truncated file fails too.
func Check(t testing.TB, file string, n int, added, got []string) {
	t.Helper()
	b, err := os.ReadFile(file) //nolint:gosec // G304: a testdata file the test names
	if err != nil {
		t.Errorf("%v", err)
		return
	}
	old := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(old) != n {
		t.Errorf("%s has %d lines, want %d", file, len(old), n)
	}
	for _, s := range old {
		if !slices.Contains(got, s) {
			t.Errorf("%q of %s is gone", s, file)
		}
	}
	want := slices.Sorted(slices.Values(append(old, added...)))
	if g := slices.Sorted(slices.Values(got)); !slices.Equal(g, want) {
		t.Errorf("got\n\t%s\nwant %s's and those added since\n\t%s", strings.Join(g, "\n\t"), file, strings.Join(want, "\n\t"))
	}
}
