package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// commit is the short revision the program reports, when the build sets it
// (-ldflags "-X main.commit=abc1234", with "-dirty" appended for a modified
// tree). Empty: ask git, then the build information.
var commit string

// revision is the commit a run measured.
type revision struct {
	short string // "unknown" when no source says
	dirty bool   // the working tree differed from short
}

func (r revision) String() string {
	if r.dirty {
		return r.short + "-dirty"
	}
	return r.short
}

// currentRevision asks, in turn, the value set at build time, git (the
// program is run from the repository, as make bench does), and the build
// information go build stamps.
func currentRevision() revision {
	if commit != "" {
		short, dirty := strings.CutSuffix(commit, "-dirty")
		return revision{short: short, dirty: dirty}
	}
	if out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		r := revision{short: strings.TrimSpace(string(out))}
		status, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output()
		r.dirty = err == nil && len(strings.TrimSpace(string(status))) > 0
		return r
	}
	info, _ := debug.ReadBuildInfo()
	return revisionFromBuild(info)
}

// revisionFromBuild reads vcs.revision and vcs.modified; info may be nil.
func revisionFromBuild(info *debug.BuildInfo) revision {
	r := revision{short: "unknown"}
	if info == nil {
		return r
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			r.short = s.Value[:min(7, len(s.Value))]
		case "vcs.modified":
			r.dirty = s.Value == "true"
		}
	}
	return r
}

// machine is what a result file says of the computer a run took place on.
type machine struct {
	goos, goarch string
	cpus         int
	cpu          string // model name
	goVersion    string
	kernel       string // uname -sr
}

func currentMachine() machine {
	kernel := "unknown"
	if out, err := exec.Command("uname", "-sr").Output(); err == nil {
		kernel = strings.TrimSpace(string(out))
	}
	return machine{
		goos: runtime.GOOS, goarch: runtime.GOARCH, cpus: runtime.NumCPU(),
		cpu: cpuModel(), goVersion: runtime.Version(), kernel: kernel,
	}
}

// runRecord is one invocation of the program, as a result file keeps it.
type runRecord struct {
	args    []string // the program's arguments, without its name
	rev     revision
	machine machine
	date    time.Time
	what    string // the slug naming the brokers and scenarios
	body    string // the report, tables included, as printed
}

// runSlug names what an invocation measured: the brokers, the payloads, the
// scenarios (all, or the first three and how many more) and a Zipf
// exponent when one was set.
func runSlug(o *options) string {
	parts := []string{strings.Join(o.brokers, "-")}
	if slices.Equal(o.brokers, brokerNames) {
		parts[0] = "all-brokers"
	}
	parts = append(parts, strings.Join(o.payloads, "-"))
	switch scens := o.scenarios; {
	case o.allScenarios:
		parts = append(parts, "all")
	case len(scens) > 4:
		parts = append(parts, strings.Join(scens[:3], "-"), fmt.Sprintf("and-%d-more", len(scens)-3))
	default:
		parts = append(parts, strings.Join(scens, "-"))
	}
	if o.zipf != 0 {
		parts = append(parts, fmt.Sprintf("zipf%g", o.zipf))
	}
	return slug(strings.Join(parts, "-"))
}

// slug keeps lower-case letters, digits and dots, one dash for any run of
// anything else.
func slug(s string) string {
	var b strings.Builder
	dash := false
	for _, c := range strings.ToLower(s) {
		if c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' {
			if dash && b.Len() > 0 {
				b.WriteByte('-')
			}
			b.WriteRune(c)
			dash = false
			continue
		}
		dash = true
	}
	return b.String()
}

// shellQuote quotes an argument the way a shell reads it back.
func shellQuote(arg string) string {
	plain := func(c rune) bool {
		return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("-_./,:=@%+", c)
	}
	if arg != "" && strings.IndexFunc(arg, func(c rune) bool { return !plain(c) }) < 0 {
		return arg
	}
	return "'" + strings.ReplaceAll(arg, "'", `'\''`) + "'"
}

// commandLine is the invocation as one would type it from the repository's
// root.
func commandLine(args []string) string {
	parts := []string{"go", "run", "./integration/bench"}
	for _, a := range args {
		parts = append(parts, shellQuote(a))
	}
	return strings.Join(parts, " ")
}

// markdown renders the result file: a header table (command, commit, date,
// machine), then the report.
func (r runRecord) markdown() string {
	var b strings.Builder
	cell := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
	dirty := ""
	if r.rev.dirty {
		dirty = " (dirty: the working tree had uncommitted changes)"
	}
	fmt.Fprintf(&b, "# Broker benchmark: %s\n\n", r.what)
	b.WriteString("| | |\n|---|---|\n")
	fmt.Fprintf(&b, "| command | `%s` |\n", cell(commandLine(r.args)))
	fmt.Fprintf(&b, "| commit | %s%s |\n", r.rev.short, dirty)
	fmt.Fprintf(&b, "| date | %s |\n", r.date.UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(&b, "| machine | %s/%s, %d CPUs (%s), kernel %s |\n",
		r.machine.goos, r.machine.goarch, r.machine.cpus, cell(r.machine.cpu), cell(r.machine.kernel))
	fmt.Fprintf(&b, "| Go | %s |\n\n", r.machine.goVersion)
	b.WriteString(r.body)
	return b.String()
}

// writeRunFile writes r into dir as YYYY-MM-DD-<commit>-<what>.md, adding
// -2, -3… rather than replacing a file of that name, and returns its path.
func writeRunFile(dir string, r runRecord) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("result file: %w", err)
	}
	base := fmt.Sprintf("%s-%s-%s", r.date.UTC().Format("2006-01-02"), r.rev.short, r.what)
	for i := 1; ; i++ {
		name := base + ".md"
		if i > 1 {
			name = fmt.Sprintf("%s-%d.md", base, i)
		}
		path := filepath.Join(dir, name)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("result file: %w", err)
		}
		_, err = f.WriteString(r.markdown())
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return "", fmt.Errorf("result file %s: %w", path, err)
		}
		return path, nil
	}
}
