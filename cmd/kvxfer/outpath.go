package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// checkOutputFile fails before a run when the output file an option names
// (flag, e.g. "--json") could not be written at the run's end: its directory
// is missing or not a directory, path is a directory, or the file cannot be
// opened (or created) for writing. It leaves an existing file as it was and
// removes the file it created to find out. An empty path is no output (nil).
// The error names the option, the path and what to do, so a soak of minutes
// does not end with a report that cannot be saved.
func checkOutputFile(flag, path string) error {
	if path == "" {
		return nil
	}
	fail := func(why string) error {
		return fmt.Errorf("%s %s: %s; nothing was run", flag, path, why)
	}
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return fail("is a directory: give a file name (e.g. " + filepath.Join(path, "out.json") + ")")
		}
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return fail(fmt.Sprintf("cannot be written (%v): fix its permissions or give another path", err))
		}
		return f.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		return fail(fmt.Sprintf("cannot be checked (%v): give another path", err))
	}
	dir := filepath.Dir(path)
	if fi, err := os.Stat(dir); err != nil {
		return fail(fmt.Sprintf("directory %s does not exist (%v): create it (mkdir -p %s) or give a path in an existing directory", dir, err, dir))
	} else if !fi.IsDir() {
		return fail(fmt.Sprintf("%s is not a directory: give a path in an existing directory", dir))
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return fail(fmt.Sprintf("cannot be created in %s (%v): give a path in a directory you can write", dir, err))
	}
	_ = f.Close()
	_ = os.Remove(path)
	return nil
}
